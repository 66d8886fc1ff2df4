//! Service tests of the orchestrator on the embedded backends: `MemoryBus`,
//! `MemorySessionStore` and an in-memory SQLite `SqlStore`.

use sb_common::session::announce_routing_change;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use chrono::Utc;
use sb_common::bus::memory::MemoryBus;
use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus, ConsumeOptions, PublishOptions, QueueSpec, Subscription};
use sb_common::retry::RetryPolicy;
use sb_common::session::SessionStore;
use sb_common::session::memory::MemorySessionStore;
use sb_common::shutdown::Shutdown;
use sb_orchestrator::events::{EventRouter, RouteOutcome};
use sb_orchestrator::plan::UnroutedReason;
use sb_orchestrator::reaper::Reaper;
use sb_orchestrator::sink::ResultSink;
use sb_orchestrator::state_keys::{StateKeyParts, scope_key};
use sb_orchestrator::{Orchestrator, OrchestratorDeps, OrchestratorOptions};
use sb_protocol::context::{ActorContext, AgentInput, DeliveryContext, StateScope};
use sb_protocol::host::{AgentEventEnvelope, AuthorizationSnapshot, RunBudgets};
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use sb_protocol::messages::{
    self, DeliveryMessage, EventBatch, EventMessage, ResultBatch, ResultMessage, RunJob,
};
use sb_protocol::result::AgentRunResult;
use sb_store::{
    AgentRow, EventStatus, NewAgent, NewEvent, RunFilter, RunStatus, RunnerRow, StateWrite, Stores,
    TranscriptQuery,
};
use serde_json::{Value, json};

mod support;

use support::eventually;

const WS: &str = "default";
const RUNNER: &str = "plugin:acme/echo/default";

struct Harness {
    bus: Arc<MemoryBus>,
    sessions: Arc<MemorySessionStore>,
    stores: Stores,
    topology: Topology,
}

fn ws() -> WorkspaceId {
    WorkspaceId::new(WS).unwrap()
}

async fn harness() -> Harness {
    harness_with_shards(2).await
}

async fn harness_with_shards(shards: u32) -> Harness {
    let b = support::memory_backends(shards).await;
    Harness {
        bus: b.bus,
        sessions: b.sessions,
        stores: b.stores,
        topology: b.topology,
    }
}

impl Harness {
    fn deps(&self) -> OrchestratorDeps {
        support::deps(
            self.bus.clone(),
            self.sessions.clone(),
            self.stores.clone(),
            self.topology.clone(),
        )
    }

    fn options(&self) -> OrchestratorOptions {
        OrchestratorOptions {
            retry: RetryPolicy::new(Duration::from_millis(10), Duration::from_secs(5)),
            ..OrchestratorOptions::default()
        }
    }

    fn router(&self) -> EventRouter {
        EventRouter::new(self.deps(), Arc::new(self.options()))
    }

    async fn register_runner(&self, id: &str, permissions: Value, capabilities: Value) {
        let parsed: sb_protocol::manifest::RunnerId = id.parse().unwrap();
        let descriptor = json!({
            "id": id,
            "label": {"en_US": "Echo"},
            "plugin_author": parsed.author(),
            "plugin_name": parsed.plugin(),
            "runner_name": parsed.runner(),
            "pool": "default",
            "permissions": permissions,
            "capabilities": capabilities,
        });
        self.stores
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
        announce_routing_change(self.sessions.as_ref())
            .await
            .unwrap();
    }

    async fn create_agent(
        &self,
        name: &str,
        runner: &str,
        scope: Value,
        runner_config: Value,
        state_policy: Value,
    ) -> AgentRow {
        let row = self
            .stores
            .agents
            .create(NewAgent {
                id: None,
                workspace_id: ws(),
                name: name.into(),
                description: None,
                runner_id: runner.into(),
                runner_config,
                event_types: json!(["message.received"]),
                scope,
                filters: json!([]),
                resource_policy: json!({}),
                state_policy,
                delivery_policy: json!({}),
                budgets: json!({}),
                enabled: true,
                routing: sb_store::AgentRouting::Scope,
            })
            .await
            .unwrap();
        // As the gateway's agent routes do: routing caches reload.
        announce_routing_change(self.sessions.as_ref())
            .await
            .unwrap();
        row
    }

    /// Appends a `message.received` event (as the gateway would) and returns its id.
    async fn ingest(&self, conversation: Option<&str>, text: &str) -> EventId {
        let event_id = EventId::new();
        let envelope = AgentEventEnvelope {
            event_id,
            workspace_id: ws(),
            event_type: "message.received".into(),
            event_time: Some(Utc::now().timestamp()),
            source: "api".into(),
            source_event_type: None,
            bot_id: Some("bot1".into()),
            conversation_id: conversation.map(Into::into),
            thread_id: None,
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
            delivery: DeliveryContext {
                supports_streaming: true,
                ..DeliveryContext::new("api")
            },
            raw_ref: None,
            data: Default::default(),
            metadata: Default::default(),
        };
        let mut event = NewEvent::new(ws(), "message.received", "api");
        event.id = Some(event_id);
        event.conversation_id = conversation.map(Into::into);
        event.input_summary = Some(text.into());
        event.envelope = Some(serde_json::to_value(&envelope).unwrap());
        self.stores.events.append(event, Vec::new()).await.unwrap();
        event_id
    }

    async fn publish_event(&self, event_id: EventId, conversation: Option<&str>) {
        self.publish_to_events(
            messages::encode(&EventMessage::new(ws(), event_id)),
            conversation,
        )
        .await;
    }

    /// Publishes `body` to the events shard of `conversation`, as the outbox relay does.
    async fn publish_to_events(&self, body: Vec<u8>, conversation: Option<&str>) {
        self.bus
            .publish(
                &self.topology.events_exchange(),
                &self.topology.events_routing_key(WS, conversation),
                body.into(),
                PublishOptions::default(),
            )
            .await
            .unwrap();
    }

    async fn publish_result(
        &self,
        run_id: RunId,
        conversation: Option<&str>,
        sequence: u64,
        result: Value,
    ) {
        let result: AgentRunResult = serde_json::from_value(result).unwrap();
        let msg = ResultMessage::new(run_id, ws(), conversation.map(Into::into), sequence, result);
        self.publish_to_results(run_id, messages::encode(&msg))
            .await;
    }

    /// Publishes `items` of `run_id` as one results message (a worker's batch).
    async fn publish_results(
        &self,
        run_id: RunId,
        conversation: Option<&str>,
        items: Vec<(u64, Value)>,
    ) {
        let batch = ResultBatch::new(
            run_id,
            ws(),
            conversation.map(Into::into),
            items
                .into_iter()
                .map(|(sequence, result)| (sequence, serde_json::from_value(result).unwrap())),
        );
        self.publish_to_results(run_id, messages::encode(&batch))
            .await;
    }

    /// Publishes `body` on the results exchange, to `run_id`'s shard.
    async fn publish_to_results(&self, run_id: RunId, body: Vec<u8>) {
        self.bus
            .publish(
                &self.topology.results_exchange(),
                &self.topology.results_routing_key(&run_id),
                body.into(),
                PublishOptions::default(),
            )
            .await
            .unwrap();
    }

    /// Whether conversation `conversation`'s transcript has an assistant row saying `text`.
    async fn has_assistant_row(&self, conversation: &str, text: &str) -> bool {
        self.stores
            .transcript
            .page(TranscriptQuery::new(ws(), conversation))
            .await
            .unwrap()
            .items
            .iter()
            .any(|i| i.role == "assistant" && i.content.as_deref() == Some(text))
    }

    async fn jobs(&self) -> Subscription {
        self.bus
            .subscribe(
                &self.topology.runs_queue("default"),
                ConsumeOptions::prefetch(100),
            )
            .await
            .unwrap()
    }

    async fn deliveries(&self) -> Subscription {
        let queue = QueueSpec::exclusive(format!("{}.test", self.topology.deliveries_exchange()))
            .bind(self.topology.deliveries_exchange(), "#");
        self.bus
            .subscribe(&queue, ConsumeOptions::prefetch(1000))
            .await
            .unwrap()
    }

    async fn run_count(&self) -> usize {
        self.stores
            .runs
            .list_runs(RunFilter::workspace(ws()), None, Some(100))
            .await
            .unwrap()
            .items
            .len()
    }
}

/// Asserts that no job arrives `within` this long (`why`: what one would mean).
async fn assert_no_job(sub: &mut Subscription, within: Duration, why: &str) {
    assert!(
        tokio::time::timeout(within, sub.next()).await.is_err(),
        "{why}"
    );
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

/// Every delivery that arrives until `quiet` passes without one.
async fn drain(sub: &mut Subscription, quiet: Duration) -> Vec<DeliveryMessage> {
    drain_messages(sub, quiet)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The deliveries of each live message that arrives until `quiet` passes without one.
async fn drain_messages(sub: &mut Subscription, quiet: Duration) -> Vec<Vec<DeliveryMessage>> {
    let mut out = Vec::new();
    while let Ok(d) = tokio::time::timeout(quiet, sub.next()).await {
        let d = d.unwrap();
        out.push(messages::decode_deliveries(&d.body).unwrap());
        d.ack().await.unwrap();
    }
    out
}

async fn standard_setup(h: &Harness, runner_config: Value) -> AgentRow {
    h.register_runner(
        RUNNER,
        json!({"history": ["page", "search"], "events": ["get"], "artifacts": ["read"], "storage": ["plugin"]}),
        json!({"streaming": true}),
    )
    .await;
    h.create_agent(
        "echo",
        RUNNER,
        json!({}),
        runner_config,
        json!({"state_scopes": ["conversation", "actor"]}),
    )
    .await
}

#[tokio::test]
async fn event_is_routed_to_a_job_with_the_right_context() {
    let h = harness().await;
    let agent = standard_setup(&h, json!({"greeting": "hi"})).await;
    let shutdown = Shutdown::new();
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), &shutdown)
        .await
        .unwrap();
    // the shard reconciler, the scheduler, the retention task, the reaper, and (alone)
    // every events and results shard
    assert_eq!(orchestrator.task_count(), 4 + 2 + 2);
    assert_eq!(orchestrator.owned_shards().events, (0..2).collect());
    assert_eq!(orchestrator.owned_shards().results, (0..2).collect());
    let mut jobs = h.jobs().await;

    let before = Utc::now().timestamp_millis();
    let event_id = h.ingest(Some("conv-1"), "hello there").await;
    h.publish_event(event_id, Some("conv-1")).await;
    let job = next_job(&mut jobs).await;

    // the job and its context
    let ctx = &job.context;
    assert_eq!(job.run_id, ctx.run_id);
    assert_eq!(ctx.runtime.trace_id, job.run_id.to_string());
    assert_eq!(job.pool, "default");
    assert_eq!(job.runner_id.to_string(), RUNNER);
    assert_eq!(ctx.event.event_id, event_id.to_string());
    assert_eq!(ctx.input.text.as_deref(), Some("hello there"));
    assert_eq!(ctx.config["greeting"], "hi");
    let deadline_ms = job
        .deadline_at_ms
        .expect("default timeout gives a deadline");
    assert!(
        (before + 299_000..=Utc::now().timestamp_millis() + 301_000).contains(&deadline_ms),
        "{deadline_ms}"
    );
    assert_eq!(
        ctx.context.latest_cursor, None,
        "no history before the first message"
    );
    let apis = ctx.context.available_apis;
    assert!(
        apis.history_page
            && apis.history_search
            && apis.event_get
            && apis.artifact_read
            && apis.state
            && apis.storage
    );
    assert!(!apis.event_page && !apis.artifact_metadata && !apis.steering_pull);
    assert!(ctx.resources.storage.plugin_storage && !ctx.resources.storage.workspace_storage);
    assert_eq!(ctx.state.conversation["external.conversation_id"], "conv-1");
    assert_eq!(
        ctx.conversation.as_ref().unwrap().sender_id.as_deref(),
        Some("alice")
    );

    // the run, the event, the session, the transcript
    let run = h.stores.runs.get_run(job.run_id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Queued);
    assert_eq!(run.event_id, event_id);
    assert_eq!(run.agent_id, Some(agent.id));
    assert_eq!(run.deadline_at.unwrap().timestamp_millis(), deadline_ms);
    let event = h.stores.events.get(event_id).await.unwrap().unwrap();
    assert_eq!(event.status, EventStatus::Dispatched);
    assert_eq!(event.run_id, Some(job.run_id));
    let snapshot: AuthorizationSnapshot = serde_json::from_value(
        h.sessions
            .get_session(&job.run_id)
            .await
            .unwrap()
            .expect("session"),
    )
    .unwrap();
    assert_eq!(snapshot.run_id, job.run_id);
    assert_eq!(snapshot.plugin_id, "acme/echo");
    assert_eq!(snapshot.resources, ctx.resources);
    assert_eq!(snapshot.available_apis, ctx.context.available_apis);
    assert_eq!(snapshot.deadline_at, ctx.runtime.deadline_at);
    // The runner gets the remote Host API token; the session keeps only its digest, and the
    // event's copy of the snapshot not even that.
    let token = ctx.runtime.metadata["host_api"]["token"]
        .as_str()
        .expect("a remote host api token");
    assert_eq!(ctx.runtime.metadata["host_api"]["url"], "/v1/host");
    assert!(snapshot.accepts_host_api_token(token));
    let session_text = serde_json::to_string(&snapshot).unwrap();
    assert!(
        !session_text.contains(token),
        "the token itself is not stored"
    );
    let mut without_digest = serde_json::to_value(&snapshot).unwrap();
    without_digest
        .as_object_mut()
        .unwrap()
        .remove("host_api_token_sha256");
    assert_eq!(event.metadata["authorization"], without_digest);
    let page = h
        .stores
        .transcript
        .page(TranscriptQuery::new(ws(), "conv-1"))
        .await
        .unwrap();
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].role, "user");
    assert_eq!(page.items[0].content.as_deref(), Some("hello there"));

    // the event delivery was acked
    let shard_queues: Vec<String> = (0..2).map(|k| h.topology.events_queue(k).name).collect();
    eventually("event ack", || async {
        shard_queues
            .iter()
            .all(|q| h.bus.ready_count(q) == Some(0) && h.bus.unacked_count(q) == Some(0))
    })
    .await;

    // a second message in the conversation sees the first in its cursor (and not its own
    // user row, which its start writes), and the state written since in its snapshot
    let conversation_scope = scope_key(
        StateScope::Conversation,
        &StateKeyParts::from_snapshot(&snapshot),
    )
    .unwrap();
    h.stores
        .state
        .set(StateWrite {
            scope_key: conversation_scope,
            scope: "conversation".into(),
            key: "topic".into(),
            value: json!({"name": "greetings"}),
            if_revision: None,
        })
        .await
        .unwrap();
    let second = h.ingest(Some("conv-1"), "again").await;
    h.publish_event(second, Some("conv-1")).await;
    let job2 = next_job(&mut jobs).await;
    assert_ne!(job2.run_id, job.run_id);
    assert_eq!(
        job2.context.context.latest_cursor.as_ref(),
        Some(&page.items[0].cursor)
    );
    assert!(job2.context.context.has_history_before);
    assert_eq!(
        job2.context.state.conversation["topic"],
        json!({"name": "greetings"})
    );
    assert_eq!(
        job2.context.state.conversation["external.conversation_id"],
        "conv-1"
    );

    shutdown.trigger();
    tokio::time::timeout(Duration::from_secs(5), orchestrator.join())
        .await
        .expect("tasks stop on shutdown");
}

/// An outbox round's events published to one shard as one message: each is routed in its
/// own lane, and the message is settled once, after all of them (an event that is not
/// there is a final error: the batch is acked, not dead-lettered).
#[tokio::test]
async fn a_batch_of_events_routes_each_and_is_settled_once() {
    use sb_common::bus::topology::{event_lane, events_shard};
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), &shutdown)
        .await
        .unwrap();
    let mut jobs = h.jobs().await;
    // Three conversations of one shard: the batch goes to one queue.
    let shards = h.topology.options().events_shards;
    let shard = events_shard(WS, Some("batch-0"), shards);
    let conversations: Vec<String> = (0..)
        .map(|i| format!("batch-{i}"))
        .filter(|c| events_shard(WS, Some(c), shards) == shard)
        .take(3)
        .collect();
    let mut events = Vec::new();
    for conversation in &conversations {
        let id = h.ingest(Some(conversation), "hello").await;
        events.push(EventMessage::new(ws(), id).in_lane(event_lane(WS, id, Some(conversation))));
    }
    let routed: std::collections::BTreeSet<String> =
        events.iter().map(|e| e.event_id.to_string()).collect();
    events.push(EventMessage::new(ws(), EventId::new()));
    h.publish_to_events(
        messages::encode(&EventBatch::new(events)),
        Some(&conversations[0]),
    )
    .await;
    let mut jobs_of = std::collections::BTreeSet::new();
    for _ in 0..3 {
        jobs_of.insert(next_job(&mut jobs).await.context.event.event_id);
    }
    assert_eq!(jobs_of, routed);
    let queue = h.topology.events_queue(shard).name;
    eventually("the batch is settled", || async {
        h.bus.ready_count(&queue) == Some(0) && h.bus.unacked_count(&queue) == Some(0)
    })
    .await;
    assert_eq!(
        h.bus.ready_count(&h.topology.dead_queue().name),
        Some(0),
        "nothing dead-lettered"
    );
    shutdown.trigger();
    orchestrator.join().await;
}

/// A batch routed only in part (one event's route lock is held elsewhere) acks what was
/// routed and sends only the rest again: the routed event's job is published once, not again
/// with every retry of its batch.
#[tokio::test]
async fn a_batch_routed_in_part_sends_only_the_rest_again() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let options = OrchestratorOptions {
        route_lock_ttl: Duration::from_millis(300),
        ..h.options()
    };
    let orchestrator = Orchestrator::spawn(h.deps(), options, &shutdown)
        .await
        .unwrap();
    let mut jobs = h.jobs().await;
    let free = h.ingest(None, "free").await;
    let held = h.ingest(None, "held").await;
    // Another consumer routes `held` (its lock outlives the test's waits).
    let lock = format!("route:{held}");
    assert!(
        h.sessions
            .acquire_lease(&lock, "elsewhere", Duration::from_secs(60))
            .await
            .unwrap()
    );
    let batch = EventBatch::new(vec![
        EventMessage::new(ws(), free).in_lane(1),
        EventMessage::new(ws(), held).in_lane(2),
    ]);
    h.publish_to_events(messages::encode(&batch), None).await;
    let first = next_job(&mut jobs).await;
    assert_eq!(first.context.event.event_id, free.to_string());
    // `held` waits for its lock and goes again, more than once, alone.
    assert_no_job(
        &mut jobs,
        Duration::from_millis(1_000),
        "a job published while the lock is held (the routed event's again?)",
    )
    .await;
    h.sessions.release_lease(&lock, "elsewhere").await.unwrap();
    let second = next_job(&mut jobs).await;
    assert_eq!(second.context.event.event_id, held.to_string());
    assert_no_job(&mut jobs, Duration::from_millis(500), "one job per event").await;
    assert_eq!(h.run_count().await, 2);
    shutdown.trigger();
    orchestrator.join().await;
}

#[tokio::test]
async fn unrouted_events_get_a_reason_and_no_run() {
    let h = harness().await;
    let router = h.router();

    // no agent at all
    let e1 = h.ingest(Some("c"), "x").await;
    let out = router.route(&EventMessage::new(ws(), e1)).await.unwrap();
    assert_eq!(out, RouteOutcome::Unrouted(UnroutedReason::BindingNotFound));
    let rec = h.stores.events.get(e1).await.unwrap().unwrap();
    assert_eq!(rec.status, EventStatus::Unrouted);
    assert_eq!(rec.reason.as_deref(), Some("binding.not_found"));

    // an agent whose runner no worker registered
    h.create_agent(
        "ghost",
        "plugin:acme/ghost/default",
        json!({}),
        json!({}),
        json!({}),
    )
    .await;
    let e2 = h.ingest(Some("c"), "x").await;
    let out = router.route(&EventMessage::new(ws(), e2)).await.unwrap();
    assert_eq!(out, RouteOutcome::Unrouted(UnroutedReason::RunnerNotFound));
    let rec = h.stores.events.get(e2).await.unwrap().unwrap();
    assert_eq!(rec.reason.as_deref(), Some("runner.not_found"));
    assert_eq!(
        rec.metadata["routing"]["runner_id"],
        "plugin:acme/ghost/default"
    );

    // two agents at the same (bot) level: ambiguous, even though one runner exists
    h.register_runner(RUNNER, json!({}), json!({})).await;
    let a = h
        .create_agent("a", RUNNER, json!({"bot_id": "bot1"}), json!({}), json!({}))
        .await;
    let b = h
        .create_agent("b", RUNNER, json!({"bot_id": "bot1"}), json!({}), json!({}))
        .await;
    let e3 = h.ingest(Some("c"), "x").await;
    let out = router.route(&EventMessage::new(ws(), e3)).await.unwrap();
    assert_eq!(
        out,
        RouteOutcome::Unrouted(UnroutedReason::BindingAmbiguous)
    );
    let rec = h.stores.events.get(e3).await.unwrap().unwrap();
    assert_eq!(rec.reason.as_deref(), Some("binding.ambiguous"));
    let ids = rec.metadata["routing"]["binding_ids"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ids.len(), 2);
    for agent in [&a, &b] {
        assert!(ids.contains(&json!(format!("agent_{}_{RUNNER}", agent.id))));
    }

    assert_eq!(h.run_count().await, 0, "never a run");
    // routing an unrouted event again changes nothing
    assert_eq!(
        router.route(&EventMessage::new(ws(), e3)).await.unwrap(),
        RouteOutcome::AlreadyHandled
    );

    // a more specific agent resolves the tie
    let conv = h
        .create_agent(
            "conv",
            RUNNER,
            json!({"conversation_id": "c"}),
            json!({}),
            json!({}),
        )
        .await;
    let e4 = h.ingest(Some("c"), "x").await;
    let RouteOutcome::Dispatched { run_id, .. } =
        router.route(&EventMessage::new(ws(), e4)).await.unwrap()
    else {
        panic!("dispatched")
    };
    assert_eq!(
        h.stores
            .runs
            .get_run(run_id)
            .await
            .unwrap()
            .unwrap()
            .agent_id,
        Some(conv.id)
    );

    // a pointer to a missing event is a final not_found
    let err = router
        .route(&EventMessage::new(ws(), EventId::new()))
        .await
        .unwrap_err();
    assert_eq!(
        sb_protocol::error::HasErrorCode::code(&err),
        sb_protocol::error::ErrorCode::NotFound
    );
}

/// The agent's budget overrides reach the run's frozen authorization snapshot (what the
/// workers enforce); budgets it does not set keep the defaults.
#[tokio::test]
async fn the_run_snapshot_carries_the_agents_budgets() {
    let h = harness().await;
    let router = h.router();
    let mut agent = standard_setup(&h, json!({})).await;
    agent.budgets = json!({"max_tool_calls": 1, "max_model_output_chars": 0});
    h.stores.agents.update(agent).await.unwrap();
    announce_routing_change(h.sessions.as_ref()).await.unwrap();

    let event_id = h.ingest(Some("conv-b"), "hello").await;
    let RouteOutcome::Dispatched { run_id, .. } = router
        .route(&EventMessage::new(ws(), event_id))
        .await
        .unwrap()
    else {
        panic!("dispatched")
    };
    let snapshot: AuthorizationSnapshot = serde_json::from_value(
        h.sessions
            .get_session(&run_id)
            .await
            .unwrap()
            .expect("session"),
    )
    .unwrap();
    assert_eq!(
        snapshot.budgets,
        RunBudgets {
            max_tool_calls: 1,
            max_model_output_chars: 0,
            ..RunBudgets::default()
        }
    );
}

#[tokio::test]
async fn redelivered_event_reuses_its_run() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let router = h.router();
    let mut jobs = h.jobs().await;
    let event_id = h.ingest(Some("c1"), "hello").await;
    let msg = EventMessage::new(ws(), event_id);

    let first = router.route(&msg).await.unwrap();
    let RouteOutcome::Dispatched {
        run_id,
        created: true,
    } = first
    else {
        panic!("{first:?}")
    };
    // redelivery while the run is still queued: same run, job published again
    let second = router.route(&msg).await.unwrap();
    assert_eq!(
        second,
        RouteOutcome::Dispatched {
            run_id,
            created: false
        }
    );
    assert_eq!(h.run_count().await, 1);
    let j1 = next_job(&mut jobs).await;
    let j2 = next_job(&mut jobs).await;
    assert_eq!((j1.run_id, j2.run_id), (run_id, run_id));
    assert_eq!(
        j1.deadline_at_ms, j2.deadline_at_ms,
        "the deadline is fixed by the first attempt"
    );
    // one user transcript row
    let page = h
        .stores
        .transcript
        .page(TranscriptQuery::new(ws(), "c1"))
        .await
        .unwrap();
    assert_eq!(page.items.len(), 1);

    // once a worker claimed the run, a redelivery does nothing
    assert!(h.stores.runs.claim_run(run_id, "w1").await.unwrap());
    assert_eq!(
        router.route(&msg).await.unwrap(),
        RouteOutcome::AlreadyHandled
    );
    assert_no_job(&mut jobs, Duration::from_millis(100), "no third job").await;
    assert_eq!(h.run_count().await, 1);
}

/// Ingests `text` in `conversation`, routes it (a dispatched run) and claims the run as
/// worker `w1`; returns the run id.
async fn claimed_run(h: &Harness, conversation: Option<&str>, text: &str) -> RunId {
    let event_id = h.ingest(conversation, text).await;
    let RouteOutcome::Dispatched { run_id, .. } = h
        .router()
        .route(&EventMessage::new(ws(), event_id))
        .await
        .unwrap()
    else {
        panic!("dispatched")
    };
    assert!(h.stores.runs.claim_run(run_id, "w1").await.unwrap());
    run_id
}

/// Starts the orchestrator and routes one event; returns the run id.
async fn running_run(
    h: &Harness,
    shutdown: &Shutdown,
    conversation: Option<&str>,
) -> (Orchestrator, RunId) {
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), shutdown)
        .await
        .unwrap();
    let run_id = claimed_run(h, conversation, "hello").await;
    (orchestrator, run_id)
}

async fn wait_status(h: &Harness, run_id: RunId, status: RunStatus) {
    eventually(&format!("run {status}"), || async {
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status == status
    })
    .await;
}

#[tokio::test]
async fn result_sink_is_idempotent() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let mut deliveries = h.deliveries().await;
    let (orchestrator, run_id) = running_run(&h, &shutdown, Some("c1")).await;

    let delta = json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": "hel"}}});
    h.publish_result(run_id, Some("c1"), 1, delta.clone()).await;
    h.publish_result(run_id, Some("c1"), 1, delta).await; // the same result again
    h.publish_result(
        run_id,
        Some("c1"),
        2,
        json!({"type": "message.delta", "data": {"chunk": {"content": "lo"}}}),
    )
    .await;
    h.publish_result(
        run_id,
        Some("c1"),
        3,
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
    )
    .await;
    wait_status(&h, run_id, RunStatus::Completed).await;

    let rows = h.stores.runs.events_after(run_id, 0, 100).await.unwrap();
    assert_eq!(
        rows.iter().map(|r| r.sequence).collect::<Vec<_>>(),
        [1, 2, 3],
        "one ledger row per sequence"
    );
    let delivered = drain(&mut deliveries, Duration::from_millis(200)).await;
    assert_eq!(
        delivered.iter().map(|d| d.sequence).collect::<Vec<_>>(),
        [1, 2, 3],
        "one delivery per sequence"
    );
    assert!(
        delivered
            .iter()
            .all(|d| d.run_id == run_id && d.conversation_id.as_deref() == Some("c1"))
    );
    assert_eq!(delivered[2].result.result_type, "run.completed");

    // a streaming-only runner still gets an assistant transcript, once
    let page = h
        .stores
        .transcript
        .page(TranscriptQuery::new(ws(), "c1"))
        .await
        .unwrap();
    let assistant: Vec<_> = page
        .items
        .iter()
        .filter(|i| i.role == "assistant")
        .collect();
    assert_eq!(assistant.len(), 1);
    assert_eq!(assistant[0].content.as_deref(), Some("hello"));
    assert_eq!(assistant[0].run_id, Some(run_id));

    // a late duplicate of the terminal changes nothing and is not delivered again
    h.publish_result(
        run_id,
        Some("c1"),
        3,
        json!({"type": "run.failed", "data": {"code": "x", "error": "late"}}),
    )
    .await;
    assert!(
        drain(&mut deliveries, Duration::from_millis(200))
            .await
            .is_empty()
    );
    assert_eq!(
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
        RunStatus::Completed
    );

    let queues: Vec<String> = (0..2).map(|k| h.topology.results_queue(k).name).collect();
    eventually("result acks", || async {
        queues
            .iter()
            .all(|q| h.bus.ready_count(q) == Some(0) && h.bus.unacked_count(q) == Some(0))
    })
    .await;
    shutdown.trigger();
    orchestrator.join().await;
}

/// A result message of `run_id` in `c1`, as a worker makes it.
fn result_message(run_id: RunId, sequence: u64, result: Value) -> ResultMessage {
    let result: AgentRunResult = serde_json::from_value(result).unwrap();
    ResultMessage::new(run_id, ws(), Some("c1".into()), sequence, result)
}

#[tokio::test]
async fn the_sink_stores_applies_and_delivers_what_a_worker_hands_over_directly() {
    use sb_protocol::error::{Disposition, HasErrorCode};
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let mut deliveries = h.deliveries().await;
    let run_id = claimed_run(&h, Some("c1"), "hello").await;
    let sink = ResultSink::new(h.deps(), Arc::new(h.options()));
    let delta = |sequence, text: &str| {
        result_message(
            run_id,
            sequence,
            json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": text}}}),
        )
    };

    // Stored and delivered once it returns, in order.
    let store = |messages: Vec<ResultMessage>, retried: bool| {
        let sink = &sink;
        async move { sink.store(vec![(messages, retried)]).await.remove(0) }
    };
    store(vec![delta(1, "hel"), delta(2, "lo")], false)
        .await
        .unwrap();
    let stored = |h: &Harness| {
        let runs = Arc::clone(&h.stores.runs);
        async move {
            runs.events_after(run_id, 0, 100)
                .await
                .unwrap()
                .iter()
                .map(|r| r.sequence)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(stored(&h).await, [1, 2]);
    let delivered = drain(&mut deliveries, Duration::from_millis(200)).await;
    assert_eq!(
        delivered.iter().map(|d| d.sequence).collect::<Vec<_>>(),
        [1, 2]
    );

    // The same items again: a plain duplicate is neither stored nor delivered twice...
    store(vec![delta(2, "lo")], false).await.unwrap();
    assert!(
        drain(&mut deliveries, Duration::from_millis(100))
            .await
            .is_empty()
    );
    // ...but a retried hand-over is applied and delivered again (its first attempt may have
    // failed after the insert).
    store(vec![delta(2, "lo")], true).await.unwrap();
    let again = drain(&mut deliveries, Duration::from_millis(200)).await;
    assert_eq!(again.iter().map(|d| d.sequence).collect::<Vec<_>>(), [2]);

    // The terminal item ends the run and writes the assembled transcript.
    let end = result_message(
        run_id,
        3,
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
    );
    store(vec![end], false).await.unwrap();
    assert_eq!(stored(&h).await, [1, 2, 3]);
    assert_eq!(
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
        RunStatus::Completed
    );
    let page = h
        .stores
        .transcript
        .page(TranscriptQuery::new(ws(), "c1"))
        .await
        .unwrap();
    let assistant: Vec<_> = page
        .items
        .iter()
        .filter(|i| i.role == "assistant")
        .collect();
    assert_eq!(assistant.len(), 1);
    assert_eq!(assistant[0].content.as_deref(), Some("hello"));

    // Nothing travelled the results queue.
    let queues: Vec<String> = (0..2).map(|k| h.topology.results_queue(k).name).collect();
    assert!(
        queues
            .iter()
            .all(|q| h.bus.ready_count(q).unwrap_or(0) == 0)
    );

    // A run the ledger does not hold is refused for good (the worker then sends its items
    // by the results queue, whose consumer settles them).
    let ghost = result_message(
        RunId::new(),
        1,
        json!({"type": "run.completed", "data": {}}),
    );
    let error = store(vec![ghost], false).await.unwrap_err();
    assert_ne!(error.code().disposition(), Disposition::Retry, "{error}");
}

#[tokio::test]
async fn hand_overs_stored_together_are_answered_each() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let mut deliveries = h.deliveries().await;
    let (a, b) = (
        claimed_run(&h, Some("c1"), "one").await,
        claimed_run(&h, Some("c2"), "two").await,
    );
    let sink = ResultSink::new(h.deps(), Arc::new(h.options()));
    let end = |run_id| {
        result_message(
            run_id,
            1,
            json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
        )
    };
    let answers = sink
        .store(vec![
            (vec![end(a)], false),
            (vec![end(RunId::new())], false),
            (vec![end(b)], false),
        ])
        .await;
    assert!(answers[0].is_ok() && answers[2].is_ok(), "{answers:?}");
    assert!(answers[1].is_err(), "{answers:?}");
    for run_id in [a, b] {
        assert_eq!(
            h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
            RunStatus::Completed
        );
    }
    let delivered = drain(&mut deliveries, Duration::from_millis(200)).await;
    let mut runs: Vec<RunId> = delivered.iter().map(|d| d.run_id).collect();
    runs.sort();
    let mut expected = vec![a, b];
    expected.sort();
    assert_eq!(runs, expected);
}

#[tokio::test]
async fn transcript_state_and_artifact_side_effects() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let mut deliveries = h.deliveries().await;
    let (orchestrator, run_id) = running_run(&h, &shutdown, Some("c1")).await;

    let content = b"hello artifact".to_vec();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&content);
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&content));
    let items = [
        json!({"type": "state.updated", "data": {"scope": "conversation", "key": "conversation_id", "value": "ext-1"}}),
        json!({"type": "state.updated", "data": {"scope": "actor", "key": "prefs", "value": {"lang": "fr"}}}),
        // runner scope is not enabled by the agent's policy: refused, the run goes on
        json!({"type": "state.updated", "data": {"scope": "runner", "key": "k", "value": 1}}),
        json!({"type": "artifact.created", "data": {"artifact_type": "file", "name": "a.txt", "mime_type": "text/plain",
               "content_base64": b64, "sha256": sha, "size_bytes": content.len()}}),
        // a declared sha256 that does not match the bytes: refused by the store's check
        json!({"type": "artifact.created", "data": {"artifact_type": "file", "artifact_id": "bad", "content_base64": b64,
               "sha256": "0".repeat(64)}}),
        json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": "done!"}}}),
        json!({"type": "run.failed", "data": {"code": "runner.crashed", "error": "boom"}}),
    ];
    for (i, item) in items.iter().enumerate() {
        h.publish_result(run_id, Some("c1"), i as u64 + 1, item.clone())
            .await;
    }
    wait_status(&h, run_id, RunStatus::Failed).await;
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.error_code.as_deref(), Some("runner.crashed"));
    assert_eq!(run.error_message.as_deref(), Some("boom"));
    assert_eq!(
        drain(&mut deliveries, Duration::from_millis(200))
            .await
            .len(),
        items.len(),
        "every item is delivered"
    );

    // state, under the deterministic keys of this run's binding
    let snapshot: AuthorizationSnapshot = serde_json::from_value(
        h.stores
            .events
            .get(run.event_id)
            .await
            .unwrap()
            .unwrap()
            .metadata["authorization"]
            .clone(),
    )
    .unwrap();
    let parts = StateKeyParts::from_snapshot(&snapshot);
    let conv_key = scope_key(StateScope::Conversation, &parts).unwrap();
    let actor_key = scope_key(StateScope::Actor, &parts).unwrap();
    let runner_key = scope_key(StateScope::Runner, &parts).unwrap();
    let v = h
        .stores
        .state
        .get(&conv_key, "external.conversation_id")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v.value, json!("ext-1"), "the alias was applied");
    let v = h
        .stores
        .state
        .get(&actor_key, "prefs")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v.value, json!({"lang": "fr"}));
    assert!(
        h.stores
            .state
            .get(&runner_key, "k")
            .await
            .unwrap()
            .is_none()
    );

    // artifacts: the good one stored and logged, the mismatching one not
    let art = h
        .stores
        .artifacts
        .metadata(&format!("{run_id}:4"))
        .await
        .unwrap();
    assert_eq!(art.run_id, Some(run_id));
    assert_eq!(art.size_bytes, Some(content.len() as i64));
    assert_eq!(art.scope, sb_store::ArtifactScope::Conversation);
    let read = h.stores.artifacts.read(&art.id, 0, None).await.unwrap();
    assert_eq!(read.content.as_deref(), Some(content.as_slice()));
    assert!(h.stores.artifacts.metadata("bad").await.is_err());
    let mut q = sb_store::EventQuery::new(ws());
    q.event_types = vec!["artifact.created".into()];
    let logged = h.stores.events.page(q).await.unwrap();
    assert_eq!(logged.items.len(), 1);
    assert_eq!(logged.items[0].run_id, Some(run_id));

    // transcript: user, then the assistant's complete message with the artifact ref
    let page = h
        .stores
        .transcript
        .page(TranscriptQuery::new(ws(), "c1"))
        .await
        .unwrap();
    let mut roles: Vec<_> = page
        .items
        .iter()
        .map(|i| (i.role.clone(), i.content.clone()))
        .collect();
    roles.reverse();
    assert_eq!(
        roles,
        [
            ("user".to_owned(), Some("hello".to_owned())),
            ("assistant".to_owned(), Some("done!".to_owned()))
        ]
    );
    let assistant = page.items.iter().find(|i| i.role == "assistant").unwrap();
    assert_eq!(
        assistant.artifact_refs.as_ref().unwrap()[0]["artifact_id"],
        format!("{run_id}:4")
    );

    shutdown.trigger();
    orchestrator.join().await;
}

/// Results of runs on many shards that are ready at once share the sink's ledger inserts
/// (the shard loops' batches go in one call) and each run still gets its own answers: every
/// item stored, applied and delivered, in order.
#[tokio::test]
async fn results_ready_on_many_shards_at_once_are_each_stored_applied_and_delivered() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let mut deliveries = h.deliveries().await;
    let mut runs = Vec::new();
    for c in 0..8 {
        let conversation = format!("c{c}");
        let run_id = claimed_run(&h, Some(&conversation), "hi").await;
        runs.push((run_id, conversation));
    }
    // All published before the sink starts: its shard loops find their batches ready at once.
    for (run_id, conversation) in &runs {
        let delta = json!({"type": "message.delta", "data": {"chunk": {"content": "he"}}});
        h.publish_result(*run_id, Some(conversation), 1, delta)
            .await;
        let done = json!({"type": "run.completed", "data": {}});
        h.publish_result(*run_id, Some(conversation), 2, done).await;
    }
    let shutdown = Shutdown::new();
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), &shutdown)
        .await
        .unwrap();
    for (run_id, _) in &runs {
        eventually("the run completed", || async {
            h.stores
                .runs
                .get_run(*run_id)
                .await
                .unwrap()
                .unwrap()
                .status
                == RunStatus::Completed
        })
        .await;
        let rows = h.stores.runs.events_after(*run_id, 0, 10).await.unwrap();
        let stored: Vec<i64> = rows.iter().map(|r| r.sequence).collect();
        assert_eq!(stored, [1, 2], "{run_id}");
    }
    let delivered = drain(&mut deliveries, Duration::from_millis(300)).await;
    for (run_id, _) in &runs {
        let live: Vec<u64> = delivered
            .iter()
            .filter(|d| d.run_id == *run_id)
            .map(|d| d.sequence)
            .collect();
        assert_eq!(live, [1, 2], "{run_id} delivered in order, once");
    }
    shutdown.trigger();
    orchestrator.join().await;
}

/// The sequences of each live message that arrives until `quiet` passes without one.
async fn drained_sequences(sub: &mut Subscription, quiet: Duration) -> Vec<Vec<u64>> {
    drain_messages(sub, quiet)
        .await
        .into_iter()
        .map(|message| message.iter().map(|d| d.sequence).collect())
        .collect()
}

/// A batch whose terminal item the insert ends and whose reply the insert transcribes (an
/// echo run's) is one live message: the items before the terminal item wait for freeing the
/// conversation rather than travel alone. A streaming-only run's terminal item writes the
/// assembled deltas after the insert: the deltas go out first, in a message of their own.
#[tokio::test]
async fn a_batch_that_the_insert_stores_whole_is_one_live_message() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let mut deliveries = h.deliveries().await;
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), &shutdown)
        .await
        .unwrap();
    let delta = |text: &str| json!({"type": "message.delta", "data": {"chunk": {"content": text}}});
    let done = json!({"type": "run.completed", "data": {}});

    let echoed = claimed_run(&h, Some("c1"), "hi").await;
    let reply = json!({"type": "message.completed", "data": {"message": {"role": "assistant", "content": "hi"}}});
    h.publish_results(
        echoed,
        Some("c1"),
        vec![(1, delta("hi")), (2, reply), (3, done.clone())],
    )
    .await;
    wait_status(&h, echoed, RunStatus::Completed).await;
    assert_eq!(
        drained_sequences(&mut deliveries, Duration::from_millis(300)).await,
        [vec![1, 2, 3]]
    );

    let streamed = claimed_run(&h, Some("c2"), "yo").await;
    h.publish_results(
        streamed,
        Some("c2"),
        vec![(1, delta("y")), (2, delta("o")), (3, done)],
    )
    .await;
    wait_status(&h, streamed, RunStatus::Completed).await;
    assert_eq!(
        drained_sequences(&mut deliveries, Duration::from_millis(300)).await,
        [vec![1, 2], vec![3]]
    );
    assert!(h.has_assistant_row("c2", "yo").await);
    shutdown.trigger();
    orchestrator.join().await;
}

#[tokio::test]
async fn reaper_times_out_overdue_runs() {
    let h = harness().await;
    standard_setup(&h, json!({"timeout": 0.05})).await;
    let mut deliveries = h.deliveries().await;
    let run_id = claimed_run(&h, Some("c1"), "slow").await;
    // a result that did arrive
    let msg = ResultMessage::new(
        run_id,
        ws(),
        Some("c1".into()),
        1,
        serde_json::from_value(
            json!({"type": "message.delta", "data": {"chunk": {"content": "par"}}}),
        )
        .unwrap(),
    );
    let seq1 = sb_store::NewRunEvent {
        run_id,
        sequence: 1,
        result_type: "message.delta".into(),
        data: sb_store::ItemJson::of(&msg.result),
        ends_run: None,
        transcript: None,
    };
    assert!(h.stores.runs.insert_event(seq1).await.unwrap());
    assert!(h.sessions.get_session(&run_id).await.unwrap().is_some());

    let options = Arc::new(OrchestratorOptions {
        session_grace: Duration::ZERO,
        ..h.options()
    });
    let sink = Arc::new(ResultSink::new(h.deps(), Arc::clone(&options)));
    let reaper = Reaper::new(h.deps(), options, sink);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reaped = reaper.reap_once().await.unwrap();
    assert_eq!(reaped, [run_id]);
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Timeout);
    assert_eq!(run.error_code.as_deref(), Some("timeout"));

    let rows = h.stores.runs.events_after(run_id, 0, 100).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].sequence, 2);
    assert_eq!(rows[1].result_type, "run.failed");
    assert_eq!(rows[1].data["data"]["code"], "timeout");
    let delivered = drain(&mut deliveries, Duration::from_millis(100)).await;
    assert_eq!(delivered.len(), 1);
    assert_eq!(
        (
            delivered[0].sequence,
            delivered[0].result.result_type.as_str()
        ),
        (2, "run.failed")
    );
    assert!(
        h.sessions.get_session(&run_id).await.unwrap().is_none(),
        "session ended"
    );
    // what was streamed is kept in the transcript
    assert!(h.has_assistant_row("c1", "par").await);

    // a second scan finds nothing to do
    assert!(reaper.reap_once().await.unwrap().is_empty());
    assert_eq!(
        h.stores.runs.get_run(run_id).await.unwrap().unwrap().status,
        RunStatus::Timeout
    );
}

#[tokio::test]
async fn results_for_unknown_runs_are_dropped_and_garbage_is_dead_lettered() {
    let h = harness().await;
    let shutdown = Shutdown::new();
    let orchestrator = Orchestrator::spawn(h.deps(), h.options(), &shutdown)
        .await
        .unwrap();
    let mut deliveries = h.deliveries().await;

    // a result of a run that does not exist: not_found → acked, nothing stored or delivered
    let ghost = RunId::new();
    h.publish_result(ghost, None, 1, json!({"type": "run.completed", "data": {}}))
        .await;
    // a body that is not a result message: invalid_argument → dead-lettered
    h.bus
        .publish(
            &h.topology.results_exchange(),
            &h.topology.results_routing_key(&ghost),
            b"{not json".to_vec().into(),
            PublishOptions::default(),
        )
        .await
        .unwrap();
    let dead = h.topology.dead_queue().name;
    eventually("dead-lettered garbage", || async {
        h.bus.ready_count(&dead) == Some(1)
    })
    .await;
    let queues: Vec<String> = (0..2).map(|k| h.topology.results_queue(k).name).collect();
    eventually("results settled", || async {
        queues
            .iter()
            .all(|q| h.bus.ready_count(q) == Some(0) && h.bus.unacked_count(q) == Some(0))
    })
    .await;
    assert!(
        h.stores
            .runs
            .events_after(ghost, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        drain(&mut deliveries, Duration::from_millis(100))
            .await
            .is_empty()
    );

    shutdown.trigger();
    orchestrator.join().await;
}

// --- shard ownership across orchestrators ---------------------------------------------------

const SHARDS: u32 = 4;

/// Two member ids that split both the events and the results shards between them (chosen
/// with the same pure assignment the orchestrators use, so the test is deterministic).
fn splitting_ids() -> (String, String) {
    use sb_orchestrator::shards::{ShardFamily, assign};
    for i in 0..100 {
        let (a, b) = (format!("orch-a{i}"), format!("orch-b{i}"));
        let both: std::collections::BTreeSet<String> = [a.clone(), b.clone()].into();
        let splits = |family| {
            let mine = assign(SHARDS, SHARDS, &both, &a)
                .into_iter()
                .filter(|(f, _)| *f == family)
                .count();
            mine > 0 && mine < SHARDS as usize
        };
        if splits(ShardFamily::Events) && splits(ShardFamily::Results) {
            return (a, b);
        }
    }
    unreachable!("some pair of ids splits 4 shards");
}

fn member_options(h: &Harness, id: &str) -> OrchestratorOptions {
    OrchestratorOptions {
        member_id: Some(id.to_owned()),
        membership_heartbeat: Duration::from_millis(50),
        // Long enough that a busy test machine never lets a live member expire; the
        // handover test relies on the explicit leave on shutdown, not on expiry.
        membership_ttl: Duration::from_secs(2),
        ..h.options()
    }
}

/// Names of the events/results consumer tasks still running under `shutdown`.
fn consumer_tasks(shutdown: &Shutdown) -> Vec<String> {
    shutdown
        .running_tasks()
        .into_iter()
        .filter(|t| t.starts_with("orchestrator.events.") || t.starts_with("orchestrator.sink."))
        .collect()
}

fn task_names(shards: &sb_orchestrator::OwnedShards) -> Vec<String> {
    let mut names: Vec<String> = shards
        .events
        .iter()
        .map(|k| format!("orchestrator.events.{k}"))
        .chain(
            shards
                .results
                .iter()
                .map(|k| format!("orchestrator.sink.{k}")),
        )
        .collect();
    names.sort();
    names
}

/// One conversation id per events shard.
fn conversation_per_shard() -> Vec<String> {
    let shards = NonZeroU32::new(SHARDS).unwrap();
    let mut found: Vec<Option<String>> = vec![None; SHARDS as usize];
    for i in 0.. {
        let conversation = format!("conv-{i}");
        let k = sb_common::bus::topology::events_shard(WS, Some(&conversation), shards);
        found[k as usize].get_or_insert(conversation);
        if found.iter().all(Option::is_some) {
            break;
        }
    }
    found.into_iter().map(Option::unwrap).collect()
}

/// Starts orchestrator `a`, then `b`, and waits until they split the shards between them
/// (disjoint, covering all, and `a` released the consumers of the shards `b` took).
async fn two_orchestrators(h: &Harness) -> ((Orchestrator, Shutdown), (Orchestrator, Shutdown)) {
    let (id_a, id_b) = splitting_ids();
    let shutdown_a = Shutdown::new();
    let a = Orchestrator::spawn(h.deps(), member_options(h, &id_a), &shutdown_a)
        .await
        .unwrap();
    assert_eq!(a.id(), id_a);
    assert_eq!(
        a.owned_shards().events.len(),
        SHARDS as usize,
        "alone, a owns all"
    );
    let shutdown_b = Shutdown::new();
    let b = Orchestrator::spawn(h.deps(), member_options(h, &id_b), &shutdown_b)
        .await
        .unwrap();
    // b saw a in the registry on its first tick.
    let mine = b.owned_shards();
    assert!(!mine.events.is_empty() && mine.events.len() < SHARDS as usize);
    assert!(!mine.results.is_empty() && mine.results.len() < SHARDS as usize);
    // a notices b on its next heartbeat and hands b's shards over.
    let theirs = tokio::time::timeout(
        Duration::from_secs(5),
        a.wait_for_shards(|s| {
            s.events.is_disjoint(&mine.events) && s.results.is_disjoint(&mine.results)
        }),
    )
    .await
    .expect("a hands shards over")
    .unwrap();
    let all: std::collections::BTreeSet<u32> = (0..SHARDS).collect();
    assert_eq!(&theirs.events | &mine.events, all);
    assert_eq!(&theirs.results | &mine.results, all);
    eventually("a's released consumers stopped", || async {
        consumer_tasks(&shutdown_a) == task_names(&theirs)
    })
    .await;
    assert_eq!(consumer_tasks(&shutdown_b), task_names(&mine));
    ((a, shutdown_a), (b, shutdown_b))
}

#[tokio::test]
async fn two_orchestrators_split_the_shards_and_route_each_event_once() {
    let h = harness_with_shards(SHARDS).await;
    standard_setup(&h, json!({})).await;
    let mut jobs = h.jobs().await;
    let ((a, shutdown_a), (b, shutdown_b)) = two_orchestrators(&h).await;

    // Three events in every shard: each becomes exactly one job.
    let mut sent = std::collections::BTreeSet::new();
    for round in 0..3 {
        for conversation in conversation_per_shard() {
            let event_id = h.ingest(Some(&conversation), &format!("m{round}")).await;
            h.publish_event(event_id, Some(&conversation)).await;
            sent.insert(event_id.to_string());
        }
    }
    let mut routed = std::collections::BTreeSet::new();
    for _ in 0..sent.len() {
        let job = next_job(&mut jobs).await;
        assert!(
            routed.insert(job.context.event.event_id),
            "one job per event"
        );
    }
    assert_eq!(routed, sent);
    assert_no_job(&mut jobs, Duration::from_millis(200), "no extra job").await;
    assert_eq!(h.run_count().await, sent.len());
    for k in 0..SHARDS {
        let q = h.topology.events_queue(k).name;
        assert_eq!(h.bus.ready_count(&q), Some(0));
        assert_eq!(h.bus.unacked_count(&q), Some(0));
    }

    shutdown_a.trigger();
    shutdown_b.trigger();
    a.join().await;
    b.join().await;
}

#[tokio::test]
async fn a_stopped_orchestrators_shards_move_to_the_other() {
    let h = harness_with_shards(SHARDS).await;
    standard_setup(&h, json!({})).await;
    let mut jobs = h.jobs().await;
    let ((a, shutdown_a), (b, shutdown_b)) = two_orchestrators(&h).await;
    let a_events = a.owned_shards().events;

    shutdown_a.trigger();
    a.join().await;
    assert!(consumer_tasks(&shutdown_a).is_empty());
    let all: std::collections::BTreeSet<u32> = (0..SHARDS).collect();
    tokio::time::timeout(
        Duration::from_secs(5),
        b.wait_for_shards(|s| s.events == all && s.results == all),
    )
    .await
    .expect("b takes every shard")
    .unwrap();

    // A new event in each shard a owned is routed by b.
    let conversations = conversation_per_shard();
    let mut sent = std::collections::BTreeSet::new();
    for k in &a_events {
        let conversation = &conversations[*k as usize];
        let event_id = h.ingest(Some(conversation), "after the handover").await;
        h.publish_event(event_id, Some(conversation)).await;
        sent.insert(event_id.to_string());
    }
    let mut routed = std::collections::BTreeSet::new();
    for _ in 0..sent.len() {
        routed.insert(next_job(&mut jobs).await.context.event.event_id);
    }
    assert_eq!(routed, sent);

    shutdown_b.trigger();
    b.join().await;
}

/// A bus that refuses every message to one exchange for good (`invalid_argument`, as the
/// broker backends answer a routing key over 255 bytes), and passes everything else to the
/// memory bus.
struct RefusingBus {
    inner: Arc<MemoryBus>,
    refused_exchange: String,
}

#[async_trait::async_trait]
impl Bus for RefusingBus {
    async fn declare_exchange(
        &self,
        spec: &sb_common::bus::ExchangeSpec,
    ) -> sb_common::bus::Result<()> {
        self.inner.declare_exchange(spec).await
    }
    async fn delete_exchange(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.delete_exchange(name).await
    }
    async fn declare_queue(&self, spec: &QueueSpec) -> sb_common::bus::Result<()> {
        self.inner.declare_queue(spec).await
    }
    async fn delete_queue(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.delete_queue(name).await
    }
    async fn inspect_queue(
        &self,
        name: &str,
    ) -> sb_common::bus::Result<Option<sb_common::bus::QueueUse>> {
        self.inner.inspect_queue(name).await
    }
    async fn retire_queue(&self, name: &str) -> sb_common::bus::Result<()> {
        self.inner.retire_queue(name).await
    }
    async fn bind(
        &self,
        queue: &str,
        binding: &sb_common::bus::Binding,
    ) -> sb_common::bus::Result<()> {
        self.inner.bind(queue, binding).await
    }
    async fn unbind(
        &self,
        queue: &str,
        binding: &sb_common::bus::Binding,
    ) -> sb_common::bus::Result<()> {
        self.inner.unbind(queue, binding).await
    }
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: bytes::Bytes,
        options: PublishOptions,
    ) -> sb_common::bus::Result<()> {
        if exchange == self.refused_exchange {
            return Err(sb_common::bus::BusError::InvalidArgument(
                "routing key longer than 255 bytes".into(),
            ));
        }
        self.inner
            .publish(exchange, routing_key, body, options)
            .await
    }
    async fn publish_batch(
        &self,
        messages: Vec<sb_common::bus::Outgoing>,
    ) -> Result<(), sb_common::bus::BatchPublishError> {
        let total = messages.len();
        let mut failed = Vec::new();
        for (index, m) in messages.into_iter().enumerate() {
            if let Err(e) = self
                .publish(&m.exchange, &m.routing_key, m.body, m.options)
                .await
            {
                failed.push((index, e));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(sb_common::bus::BatchPublishError { total, failed })
        }
    }
    async fn subscribe(
        &self,
        queue: &QueueSpec,
        options: ConsumeOptions,
    ) -> sb_common::bus::Result<Subscription> {
        self.inner.subscribe(queue, options).await
    }
    async fn ping(&self) -> sb_common::bus::Result<()> {
        self.inner.ping().await
    }
    async fn close(&self) -> sb_common::bus::Result<()> {
        self.inner.close().await
    }
}

/// Issue 15 finding 1: a live delivery the bus refuses for good (a permanent error, not an
/// outage) used to be requeued as "bus unavailable" forever, stalling the results shard and
/// keeping the run `running` until the reaper gave it a second terminal item. It is dropped
/// now: the items are in the ledger, the run finishes once, the shard moves on.
#[tokio::test]
async fn a_delivery_the_bus_refuses_for_good_does_not_stall_the_shard() {
    let h = harness().await;
    standard_setup(&h, json!({})).await;
    let shutdown = Shutdown::new();
    let deps = OrchestratorDeps {
        bus: Arc::new(RefusingBus {
            inner: h.bus.clone(),
            refused_exchange: h.topology.deliveries_exchange(),
        }),
        ..h.deps()
    };
    let orchestrator = Orchestrator::spawn(deps, h.options(), &shutdown)
        .await
        .unwrap();
    let run_id = claimed_run(&h, Some("c1"), "hello").await;

    h.publish_result(
        run_id,
        Some("c1"),
        1,
        json!({"type": "message.delta", "data": {"chunk": {"role": "assistant", "content": "hi"}}}),
    )
    .await;
    h.publish_result(
        run_id,
        Some("c1"),
        2,
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
    )
    .await;
    wait_status(&h, run_id, RunStatus::Completed).await;
    let rows = h.stores.runs.events_after(run_id, 0, 100).await.unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r.result_type.as_str())
            .collect::<Vec<_>>(),
        ["message.delta", "run.completed"],
        "every item is in the ledger, with one terminal item"
    );
    let queues: Vec<String> = (0..2).map(|k| h.topology.results_queue(k).name).collect();
    eventually("results acked, none requeued or dead-lettered", || async {
        queues
            .iter()
            .all(|q| h.bus.ready_count(q) == Some(0) && h.bus.unacked_count(q) == Some(0))
            && h.bus.ready_count(&h.topology.dead_queue().name) == Some(0)
    })
    .await;
    shutdown.trigger();
    orchestrator.join().await;
}

/// Issue 15 finding 1 (its end): a run whose own terminal item is in the ledger but was never
/// applied (its delivery was dead-lettered) used to be timed out by the reaper, which added a
/// second terminal item (`run.completed`, then `run.failed`). The stored item ends it now.
#[tokio::test]
async fn the_reaper_finishes_a_run_from_its_stored_terminal_item_once() {
    let h = harness().await;
    standard_setup(&h, json!({"timeout": 0.05})).await;
    let mut deliveries = h.deliveries().await;
    let run_id = claimed_run(&h, Some("c1"), "hello").await;
    for (sequence, result) in [
        (
            1,
            json!({"type": "message.delta", "data": {"chunk": {"content": "hi"}}}),
        ),
        (
            2,
            json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
        ),
    ] {
        let row = sb_store::NewRunEvent {
            run_id,
            sequence,
            result_type: result["type"].as_str().unwrap().into(),
            data: result.into(),
            ends_run: None,
            transcript: None,
        };
        assert!(h.stores.runs.insert_event(row).await.unwrap());
    }

    let options = Arc::new(OrchestratorOptions {
        session_grace: Duration::ZERO,
        ..h.options()
    });
    let sink = Arc::new(ResultSink::new(h.deps(), Arc::clone(&options)));
    let reaper = Reaper::new(h.deps(), options, sink);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reaper.reap_once().await.unwrap(), [run_id]);
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Completed, "the runner's own outcome");
    let rows = h.stores.runs.events_after(run_id, 0, 100).await.unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r.result_type.as_str())
            .collect::<Vec<_>>(),
        ["message.delta", "run.completed"],
        "no second terminal item"
    );
    let delivered = drain(&mut deliveries, Duration::from_millis(100)).await;
    assert_eq!(
        delivered
            .iter()
            .map(|d| (d.sequence, d.result.result_type.as_str()))
            .collect::<Vec<_>>(),
        [(2, "run.completed")],
        "streams of the run end"
    );
    assert!(
        h.sessions.get_session(&run_id).await.unwrap().is_none(),
        "session ended"
    );
    assert!(reaper.reap_once().await.unwrap().is_empty());
}

/// Issue 15 finding 6: a run `running` in the ledger whose worker lease stays missing for
/// longer than the grace (its worker died, its job is never redelivered) is finalized
/// `interrupted` with exactly one terminal item; a run whose lease is held is left alone,
/// and a lease missing at one scan only (a session store that just came back empty, before
/// the worker's next heartbeat) does not finalize anything.
#[tokio::test]
async fn reaper_interrupts_runs_whose_lease_stays_missing() {
    let h = harness().await;
    // No deadline: only the lease decides.
    standard_setup(&h, json!({"timeout": 0})).await;
    let mut deliveries = h.deliveries().await;
    let route = |text: &'static str| {
        let h = &h;
        async move {
            let event_id = h.ingest(Some("c1"), text).await;
            let RouteOutcome::Dispatched { run_id, .. } = h
                .router()
                .route(&EventMessage::new(ws(), event_id))
                .await
                .unwrap()
            else {
                panic!()
            };
            run_id
        }
    };
    let lost = route("lost").await;
    let alive = route("alive").await;
    // Its worker published the terminal item and released the lease; the sink lags (e.g.
    // its orchestrator died): it is the sink's to end, not the reaper's.
    let handed_off = route("handed off").await;
    assert!(h.stores.runs.claim_run(lost, "w1").await.unwrap());
    assert!(h.stores.runs.claim_run(alive, "w2").await.unwrap());
    assert!(h.stores.runs.claim_run(handed_off, "w2").await.unwrap());
    h.sessions
        .set_ex(
            &sb_common::session::run_handed_off_key(&handed_off),
            b"w2",
            sb_common::session::RUN_HANDED_OFF_TTL,
        )
        .await
        .unwrap();
    assert!(
        h.stores
            .runs
            .get_run(lost)
            .await
            .unwrap()
            .unwrap()
            .deadline_at
            .is_none()
    );
    let alive_key = sb_common::session::run_lease_key(&alive);
    assert!(
        h.sessions
            .acquire_lease(&alive_key, "w2", Duration::from_secs(60))
            .await
            .unwrap()
    );

    let options = Arc::new(OrchestratorOptions {
        session_grace: Duration::from_millis(300),
        ..h.options()
    });
    let sink = Arc::new(ResultSink::new(h.deps(), Arc::clone(&options)));
    let reaper = Reaper::new(h.deps(), options, sink);
    assert!(
        reaper.reap_once().await.unwrap().is_empty(),
        "a lease missing at one scan is not yet expired"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(reaper.reap_once().await.unwrap(), [lost]);

    let run = h.stores.runs.get_run(lost).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    assert_eq!(run.error_code.as_deref(), Some("interrupted"));
    let rows = h.stores.runs.events_after(lost, 0, 100).await.unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| (r.sequence, r.result_type.as_str()))
            .collect::<Vec<_>>(),
        [(1, "run.failed")]
    );
    assert_eq!(rows[0].data["data"]["code"], "interrupted");
    let delivered = drain(&mut deliveries, Duration::from_millis(100)).await;
    assert_eq!(
        delivered
            .iter()
            .map(|d| (d.run_id, d.sequence))
            .collect::<Vec<_>>(),
        [(lost, 1)]
    );
    assert!(
        h.sessions.get_session(&lost).await.unwrap().is_none(),
        "session ended"
    );
    assert_eq!(
        h.stores.runs.get_run(alive).await.unwrap().unwrap().status,
        RunStatus::Running
    );
    assert_eq!(
        h.stores
            .runs
            .get_run(handed_off)
            .await
            .unwrap()
            .unwrap()
            .status,
        RunStatus::Running,
        "a handed-off run is left to the sink"
    );

    // The lost worker's terminal item arriving late is not stored: one terminal item.
    let late = sb_store::NewRunEvent {
        run_id: lost,
        sequence: 2,
        result_type: "run.completed".into(),
        data: json!({"type": "run.completed", "data": {}}).into(),
        ends_run: None,
        transcript: None,
    };
    assert!(!h.stores.runs.insert_event(late).await.unwrap());
    assert!(reaper.reap_once().await.unwrap().is_empty());
}

/// Issue 15 finding 6: a run without a deadline is bounded by `limits.run_max_duration`:
/// the reaper finalizes it `timeout` (queued or running), with one terminal item.
#[tokio::test]
async fn reaper_bounds_runs_without_a_deadline_by_the_deployment_maximum() {
    let h = harness().await;
    standard_setup(&h, json!({"timeout": 0})).await;
    let run_id = claimed_run(&h, Some("c1"), "forever").await;
    // Its worker is alive: only the maximum duration ends it.
    let key = sb_common::session::run_lease_key(&run_id);
    assert!(
        h.sessions
            .acquire_lease(&key, "w1", Duration::from_secs(60))
            .await
            .unwrap()
    );
    let options = Arc::new(OrchestratorOptions {
        run_max_duration: Duration::from_millis(200),
        ..h.options()
    });
    let sink = Arc::new(ResultSink::new(h.deps(), Arc::clone(&options)));
    let reaper = Reaper::new(h.deps(), options, sink);
    assert!(reaper.reap_once().await.unwrap().is_empty());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(reaper.reap_once().await.unwrap(), [run_id]);
    let run = h.stores.runs.get_run(run_id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Timeout);
    let rows = h.stores.runs.events_after(run_id, 0, 100).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].result_type, "run.failed");
    assert_eq!(rows[0].data["data"]["code"], "timeout");
    assert!(reaper.reap_once().await.unwrap().is_empty());
}
