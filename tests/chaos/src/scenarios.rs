//! The faults, one scenario each, and how a scenario runs:
//!
//! 1. the load starts ([`crate::load::send_events`]: events at a fixed rate, a follower per
//!    accepted event);
//! 2. halfway through the load the fault is **injected** (the disruptive moment: a SIGKILL,
//!    a SIGSTOP, a service stopped, …) and the clock of the recovery starts;
//! 3. a probe posts small events one after another until one completes: the **recovery
//!    time** is from the injection to that completion (the cluster answering and finishing
//!    again);
//! 4. meanwhile the fault is **healed** the way an operator's supervisor would (the killed
//!    process started again, the stopped one resumed, the service started again), so every
//!    scenario leaves the 1 + 2 + 2 cluster whole for the next one;
//! 5. once the load's followers are done, every accepted event (probes included) is read
//!    back and judged ([`crate::check::judge`]).
//!
//! | scenario | injected | healed |
//! | --- | --- | --- |
//! | `baseline` | nothing | — |
//! | `kill_gateway` | SIGKILL of the gateway (the only one: ingest is down) | started again on its port after 1 s |
//! | `kill_orchestrator` | SIGKILL of orchestrator 0 | started again after 1 s |
//! | `kill_worker` | SIGKILL of worker 0 (its runs must end `interrupted`, not run again) | started again once its leases expired |
//! | `kill_runner` | SIGKILL of worker 0's shared runner process, mid-stream | the worker starts a new one |
//! | `duplicate_delivery` | every job published for 3 s is published a second time on the runs exchange | — |
//! | `stop_worker` | SIGSTOP of worker 0, held past its lease TTL + grace | SIGCONT |
//! | `restart_redis` | Redis stopped (no persistence: it comes back empty) | started again |
//! | `restart_rabbitmq` | RabbitMQ stopped | started again on its data |
//! | `restart_postgres` | Postgres fast shutdown, down for 12 s | started again |
//! | `poison` | a third of the load on 255-character conversation ids; NUL in a body (must be `400`), NUL in runner output, a run past `limits.run_items_max` | — |
//!
//! `must_complete` scenarios cannot interrupt a run, so there every run must end
//! `completed`; in the others, runs caught by the fault may end `interrupted` or `failed`,
//! but still exactly once, dense, and with one terminal item.

use std::time::Duration;

use nix::sys::signal::Signal;
use sb_common::bus::amqp::{AmqpBus, AmqpOptions};
use sb_common::bus::topology::runs_routing_key;
use sb_common::bus::{Bus as _, ConsumeOptions, PublishOptions, QueueSpec};
use sb_tests::cluster::{Role, TestCluster, child_processes};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::check::{self, EventObservation, RunObservation, Tally};
use crate::load::{Api, Planned, send_events};
use crate::services::{OwnServices, Service};

/// Lease settings of the cluster (short, so that the faults resolve within seconds).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// See [`HEARTBEAT_INTERVAL`].
pub const LEASE_TTL: Duration = Duration::from_secs(3);
/// `orchestrator.lease_grace`.
pub const LEASE_GRACE: Duration = Duration::from_secs(2);
/// `orchestrator.reaper_interval`.
pub const REAPER_INTERVAL: Duration = Duration::from_secs(1);
/// `limits.run_items_max` of the cluster (the poison scenario runs past it).
pub const RUN_ITEMS_MAX: u64 = 500;
/// How long `restart_postgres` keeps the database down: past the delivery limit's retries.
const POSTGRES_OUTAGE: Duration = Duration::from_secs(12);
/// Longest time a fault's injection and healing may take.
const HEAL_TIMEOUT: Duration = Duration::from_secs(150);
/// Longest wait for a probe to complete after an injection.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// No fault: the reference.
    Baseline,
    /// SIGKILL of the gateway.
    KillGateway,
    /// SIGKILL of an orchestrator.
    KillOrchestrator,
    /// SIGKILL of a worker.
    KillWorker,
    /// SIGKILL of a worker's runner process.
    KillRunner,
    /// Jobs published twice.
    DuplicateDelivery,
    /// SIGSTOP of a worker past its lease, then SIGCONT.
    StopWorker,
    /// Redis restarted empty.
    RestartRedis,
    /// RabbitMQ restarted.
    #[serde(rename = "restart_rabbitmq")]
    RestartRabbitMq,
    /// Postgres restarted.
    RestartPostgres,
    /// Poison inputs.
    Poison,
}

impl Fault {
    /// Every scenario, in the order they run.
    pub const ALL: [Fault; 11] = [
        Fault::Baseline,
        Fault::KillGateway,
        Fault::KillOrchestrator,
        Fault::KillWorker,
        Fault::KillRunner,
        Fault::DuplicateDelivery,
        Fault::StopWorker,
        Fault::RestartRedis,
        Fault::RestartRabbitMq,
        Fault::RestartPostgres,
        Fault::Poison,
    ];

    /// Its name in reports (`kill_worker`, …).
    #[must_use]
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    }

    /// Whether every run must end `completed` (the fault cannot interrupt a run).
    #[must_use]
    pub fn must_complete(self) -> bool {
        matches!(
            self,
            Fault::Baseline
                | Fault::KillGateway
                | Fault::KillOrchestrator
                | Fault::DuplicateDelivery
                | Fault::RestartRedis
        )
    }
}

/// How much load a scenario gets.
#[derive(Debug, Clone, Serialize)]
pub struct Load {
    /// Events per scenario.
    pub events: usize,
    /// Events per second.
    pub rate: f64,
    /// Deltas of each run (`slow <n>`: 5 ms apart).
    pub deltas: u32,
    /// How long followers and posts may take after the load started.
    #[serde(with = "secs")]
    pub deadline: Duration,
}

mod secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

/// The outcome of one scenario: the report's row.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: String,
    /// Whether every run had to complete.
    pub must_complete: bool,
    /// The counters.
    #[serde(flatten)]
    pub tally: Tally,
    /// Events refused (`4xx`) or never answered, which the load never expects.
    pub refused: usize,
    /// Events never answered before the deadline.
    pub unanswered: usize,
    /// Seconds from the injection until a probe completed (`None`: none did).
    pub recovery_seconds: Option<f64>,
    /// Seconds the whole scenario took.
    pub wall_seconds: f64,
    /// Scenario-specific expectations that failed (poison inputs).
    pub expectation_failures: Vec<String>,
    /// Every guarantee that failed (empty: the scenario passed).
    pub violations: Vec<String>,
}

/// What a scenario acts on.
pub struct Context<'a> {
    /// The services.
    pub services: &'a mut OwnServices,
    /// The cluster.
    pub cluster: &'a mut TestCluster,
    /// The gateways' client.
    pub api: Api,
    /// The load.
    pub load: Load,
}

/// Runs one scenario (see the module docs).
pub async fn run(ctx: &mut Context<'_>, fault: Fault) -> ScenarioReport {
    let started = Instant::now();
    let name = fault.name();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..6].to_owned();
    let mut plan: Vec<Planned> = (0..ctx.load.events)
        .map(|i| {
            let conversation = if fault == Fault::Poison && i % 3 == 1 {
                long_conversation(&format!("{tag}-{i}"))
            } else {
                format!("chaos-{name}-{tag}-{i}")
            };
            Planned::message(conversation, &format!("slow {}", ctx.load.deltas), true)
        })
        .collect();
    let mut expectation_failures = Vec::new();
    let mut special = Vec::new();
    if fault == Fault::Poison {
        expectation_failures.extend(nul_refusals(&ctx.api).await);
        let nul = Planned::message(format!("chaos-nul-{tag}"), &nul_delta_script(), false);
        let many = Planned::message(
            format!("chaos-many-{tag}"),
            &format!("slow {}", RUN_ITEMS_MAX + 100),
            true,
        );
        special.push((nul.conversation.clone(), "nul"));
        special.push((many.conversation.clone(), "many"));
        plan.insert(1, nul);
        plan.insert(2, many);
    }

    let deadline = Instant::now() + ctx.load.deadline;
    let (halfway_tx, halfway_rx) = tokio::sync::oneshot::channel();
    let load = {
        let api = ctx.api.clone();
        let rate = ctx.load.rate;
        tokio::spawn(async move { send_events(&api, plan, rate, deadline, halfway_tx).await })
    };
    let _ = halfway_rx.await;

    let injected = Instant::now();
    let probe = {
        let api = ctx.api.clone();
        let name = name.clone();
        tokio::spawn(async move { probe(&api, &name, injected + RECOVERY_TIMEOUT).await })
    };
    match tokio::time::timeout(HEAL_TIMEOUT, inject_and_heal(ctx, fault)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => expectation_failures.push(format!(
            "the fault could not be injected or healed: {error}"
        )),
        Err(_) => {
            expectation_failures.push(format!("the fault was not healed in {HEAL_TIMEOUT:?}"))
        }
    }
    let (recovered, probes) = probe.await.unwrap_or((None, Vec::new()));
    let recovery_seconds = recovered.map(|at| at.duration_since(injected).as_secs_f64());
    let sent = load.await.unwrap_or_default();

    // Read back.
    let settle = Instant::now() + Duration::from_secs(30);
    let mut observations = Vec::new();
    for accepted in &sent.accepted {
        let observation = observe(
            &ctx.api,
            &accepted.planned.conversation,
            accepted.planned.numbered,
            Some(accepted.follower.clone()),
            settle,
        )
        .await;
        if let Some((_, kind)) = special
            .iter()
            .find(|(c, _)| *c == accepted.planned.conversation)
        {
            expectation_failures.extend(poison_expectation(kind, &observation));
        }
        observations.push(observation);
    }
    for conversation in &probes {
        observations.push(observe(&ctx.api, conversation, true, None, settle).await);
    }
    let tally = check::judge(&observations);
    let mut violations = tally.violations(fault.must_complete());
    if fault == Fault::Poison {
        // The oversized run fails by design; every other run must complete.
        let failed = tally.not_completed();
        if failed != 1 {
            violations.push(format!(
                "poison: {failed} runs did not complete (only the oversized one may): {:?}",
                tally.statuses
            ));
        }
    }
    if recovery_seconds.is_none() {
        violations.push("no probe completed after the fault".to_owned());
    }
    if !sent.refused.is_empty() || sent.unanswered > 0 {
        violations.push(format!(
            "events refused {:?} or unanswered ({})",
            sent.refused, sent.unanswered
        ));
    }
    violations.extend(expectation_failures.iter().cloned());
    ScenarioReport {
        scenario: name,
        must_complete: fault.must_complete(),
        tally,
        refused: sent.refused.len(),
        unanswered: sent.unanswered,
        recovery_seconds,
        wall_seconds: started.elapsed().as_secs_f64(),
        expectation_failures,
        violations,
    }
}

/// The fault's injection, then its healing (see the module docs' table).
async fn inject_and_heal(ctx: &mut Context<'_>, fault: Fault) -> Result<(), String> {
    let e = |e: Box<dyn std::error::Error + Send + Sync>| e.to_string();
    match fault {
        Fault::Baseline | Fault::Poison => {}
        Fault::KillGateway | Fault::KillOrchestrator | Fault::KillWorker => {
            let role = match fault {
                Fault::KillGateway => Role::Gateway,
                Fault::KillOrchestrator => Role::Orchestrator,
                _ => Role::Worker,
            };
            let name = ctx.cluster.process_names_of(role)[0].clone();
            ctx.cluster.kill_process(&name).map_err(e)?;
            let down = if role == Role::Worker {
                // Its runs must be finalized by the others, not resumed by its successor.
                LEASE_TTL + LEASE_GRACE + REAPER_INTERVAL * 2
            } else {
                Duration::from_secs(1)
            };
            tokio::time::sleep(down).await;
            ctx.cluster.restart_process(&name).await.map_err(e)?;
        }
        Fault::KillRunner => {
            let name = ctx.cluster.process_names_of(Role::Worker)[0].clone();
            let pid = ctx.cluster.pid_of(&name).ok_or("no worker pid")?;
            let runners = child_processes(pid, "sb-test-runner");
            if runners.is_empty() {
                return Err(format!("{name} has no runner process"));
            }
            for runner in runners {
                let pid = nix::unistd::Pid::from_raw(i32::try_from(runner).unwrap_or(i32::MAX));
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            }
        }
        Fault::DuplicateDelivery => duplicate_jobs(ctx, Duration::from_secs(3)).await?,
        Fault::StopWorker => {
            let name = ctx.cluster.process_names_of(Role::Worker)[0].clone();
            ctx.cluster
                .signal_process(&name, Signal::SIGSTOP)
                .map_err(e)?;
            tokio::time::sleep(LEASE_TTL + LEASE_GRACE + REAPER_INTERVAL * 3).await;
            ctx.cluster
                .signal_process(&name, Signal::SIGCONT)
                .map_err(e)?;
        }
        Fault::RestartRedis | Fault::RestartRabbitMq | Fault::RestartPostgres => {
            let service = match fault {
                Fault::RestartRedis => Service::Redis,
                Fault::RestartRabbitMq => Service::RabbitMq,
                _ => Service::Postgres,
            };
            // Postgres stays down longer than the results and events queues' quick retries
            // (`bus.delivery_limit` returns, ≈ 3 s of backoff): a consumer that requeued on
            // a ledger failure would dead-letter what it holds (the sink once left a run
            // without its terminal item that way).
            let outage = if service == Service::Postgres {
                POSTGRES_OUTAGE
            } else {
                Duration::ZERO
            };
            ctx.services
                .restart_after(service, outage)
                .await
                .map_err(e)?;
        }
    }
    Ok(())
}

/// For `window`, publishes a second copy of every job that the runs exchange routes (a tap
/// queue bound like the workers' receives a copy of each), once per job.
async fn duplicate_jobs(ctx: &Context<'_>, window: Duration) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let topology = ctx.cluster.topology().map_err(|x| e(&x))?;
    let bus = AmqpBus::connect(AmqpOptions::new(
        ctx.services.urls().amqp_url.clone(),
        "sb-chaos job tap",
    ))
    .await
    .map_err(|x| e(&x))?;
    let tap = QueueSpec::exclusive(format!("{}.chaos-tap", topology.runs_exchange()))
        .bind(topology.runs_exchange(), runs_routing_key("default"));
    let mut tapped = bus
        .subscribe(&tap, ConsumeOptions::prefetch(32))
        .await
        .map_err(|x| e(&x))?;
    let end = Instant::now() + window;
    // The copies come back through the tap too: each job is published again once only.
    let mut seen = std::collections::HashSet::new();
    let mut copies = 0;
    while Instant::now() < end {
        let Ok(Ok(delivery)) = tokio::time::timeout_at(end, tapped.next()).await else {
            break;
        };
        let body = delivery.body.clone();
        let _ = delivery.ack().await;
        if !seen.insert(body.clone()) {
            continue;
        }
        bus.publish(
            &topology.runs_exchange(),
            &runs_routing_key("default"),
            body,
            PublishOptions::default(),
        )
        .await
        .map_err(|x| e(&x))?;
        copies += 1;
    }
    drop(tapped);
    let _ = bus.close().await;
    if copies == 0 {
        return Err("no job was published during the window".to_owned());
    }
    Ok(())
}

/// Posts small events until one completes or `deadline`; returns when it completed and the
/// conversations of every probe posted.
async fn probe(api: &Api, scenario: &str, deadline: Instant) -> (Option<Instant>, Vec<String>) {
    let mut conversations = Vec::new();
    while Instant::now() < deadline {
        let planned = Planned::message(
            format!("chaos-{scenario}-probe-{}", conversations.len()),
            "slow 5",
            true,
        );
        conversations.push(planned.conversation.clone());
        let answer = api
            .post_until_answered(&planned.body, &planned.idempotency_key, deadline)
            .await;
        let Some((202, body)) = answer else {
            continue;
        };
        let event_id = body["event_id"].as_str().unwrap_or_default();
        // A probe caught by the fault itself may end `interrupted`: then another one.
        let per_probe = (Instant::now() + Duration::from_secs(30)).min(deadline);
        let Some(run_id) = api.run_of(event_id, per_probe).await else {
            continue;
        };
        loop {
            match api.run_status(&run_id, per_probe).await.as_deref() {
                Some("completed") => return (Some(Instant::now()), conversations),
                Some(status) if check::is_terminal_status(status) => break,
                _ if Instant::now() >= per_probe => break,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    (None, conversations)
}

/// Reads back the runs of `conversation`, waiting until `settle` for them to be terminal and
/// to have their terminal item.
async fn observe(
    api: &Api,
    conversation: &str,
    numbered_deltas: bool,
    follower: Option<check::FollowerOutcome>,
    settle: Instant,
) -> EventObservation {
    loop {
        let ids = api
            .runs_of_conversation(conversation, settle)
            .await
            .unwrap_or_default();
        let mut runs = Vec::new();
        for id in &ids {
            let status = api.run_status(id, settle).await.unwrap_or_default();
            let items = api.run_items(id, settle).await.unwrap_or_default();
            runs.push(RunObservation { status, items });
        }
        let settled = !runs.is_empty()
            && runs.iter().all(|r| {
                check::is_terminal_status(&r.status) && r.items.iter().any(|i| i.is_terminal())
            });
        if settled || Instant::now() >= settle {
            return EventObservation {
                runs,
                follower,
                numbered_deltas,
            };
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A conversation id of the longest accepted length (255 characters), multi-byte characters
/// and topic-syntax characters included, unique by `unique`.
fn long_conversation(unique: &str) -> String {
    let head = format!("{unique}.*#");
    let mut id = head.clone();
    while id.chars().count() < 255 {
        id.push(if id.len() % 2 == 0 { 'é' } else { 'c' });
    }
    id
}

/// A `raw` script whose delta carries a NUL (written as the JSON escape inside the text; the
/// runner's parser makes it the character).
fn nul_delta_script() -> String {
    let script = r#"[{"type":"message.delta","data":{"chunk":{"role":"assistant","content":"a\u0000b"}}},{"type":"message.completed","data":{"message":{"role":"assistant","content":"a\u0000b"}}}]"#;
    format!("raw {script}")
}

/// NUL in an ingest body must be refused with `400 invalid_argument`; returns what was not.
async fn nul_refusals(api: &Api) -> Vec<String> {
    let mut failures = Vec::new();
    let mut body = Planned::message("chaos-nul-in".to_owned(), "a\u{0}b", false).body;
    let cases = [
        ("input.text", body.clone()),
        ("conversation_id", {
            body["input"]["text"] = json!("fine");
            body["conversation_id"] = json!("nul\u{0}conversation");
            body.clone()
        }),
    ];
    for (what, body) in cases {
        let key = format!("nul-{}", uuid::Uuid::new_v4().simple());
        match api.post_event(&body, &key).await {
            Some((400, answer)) if answer["code"] == "invalid_argument" => {}
            other => failures.push(format!("NUL in {what} answered {other:?}, not 400")),
        }
    }
    failures
}

/// The specific outcome a poison event must have.
fn poison_expectation(kind: &str, observation: &EventObservation) -> Vec<String> {
    let Some(run) = observation.runs.first() else {
        return vec![format!("poison {kind}: no run")];
    };
    let last = run.items.last();
    match kind {
        "nul" => {
            let replaced = run
                .items
                .first()
                .is_some_and(|i| check::delta_text(i) == "a\u{FFFD}b");
            if run.status == "completed" && replaced {
                Vec::new()
            } else {
                vec![format!(
                    "poison nul: run {} with first delta {:?}, expected completed with U+FFFD",
                    run.status,
                    run.items.first().map(check::delta_text)
                )]
            }
        }
        _ => {
            let code = last
                .and_then(|i| i.data.get("code"))
                .and_then(|c| c.as_str());
            let within = run.items.len() as u64 <= RUN_ITEMS_MAX;
            if run.status == "failed" && code == Some("runner.too_many_items") && within {
                Vec::new()
            } else {
                vec![format!(
                    "poison item count: run {} with {} items ending {:?}, expected failed \
                     (runner.too_many_items) within {RUN_ITEMS_MAX}",
                    run.status,
                    run.items.len(),
                    code
                )]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_conversations_have_the_longest_accepted_length() {
        let id = long_conversation("abc-1");
        assert_eq!(id.chars().count(), 255);
        assert!(id.starts_with("abc-1.*#") && id.contains('é'));
        assert_ne!(long_conversation("abc-2"), id);
    }

    #[test]
    fn every_fault_has_a_distinct_name() {
        let names: std::collections::BTreeSet<String> =
            Fault::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), Fault::ALL.len());
        assert!(names.contains("restart_rabbitmq"), "{names:?}");
    }
}
