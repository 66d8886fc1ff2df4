//! Steering decisions as data (SPEC §7, host-behaviour §11, §15
//! `try_claim_steering_from_query`): which active run, if any, absorbs a new message, the
//! item pushed to its steering list, and the metadata of a claimed event.
//! Nothing here does I/O; the event consumer (`events`) applies it.
//!
//! ```text
//! message.received ─▶ binding + runner ─▶ target(event, runner, active runs)
//!                                            ├─ None ───────────▶ concurrency policy
//!                                            └─ Some(run) ─▶ steering_push(run, item(..))
//!                                                              ├─ accepted ─▶ event `claimed`
//!                                                              └─ full / run gone ─▶ concurrency policy
//! ```
//!
//! # The item
//!
//! A pushed item is a [`SteeringItem`] (`sb_protocol::proxy`), the shape `steering_pull`
//! returns to runners (host-behaviour §11 "Steering item shape"): `claimed_run_id`,
//! `runner_id`, `claimed_at`, `event`, `conversation`, `actor`, `subject`, `input`,
//! `metadata`. The worker's `steering_pull` pops the same JSON from the session store, so
//! this type is the contract between the two roles.
//!
//! # Audit rows
//!
//! The `steering.injected` / `steering.dropped` event-log rows of an item are built by
//! `sb_store::audit` (the worker writes both kinds, the reaper writes `steering.dropped`).

use sb_protocol::host::{AgentEventEnvelope, AuthorizationSnapshot, event_types};
use sb_protocol::ids::RunId;
use sb_protocol::manifest::RunnerId;
use sb_protocol::proxy::{SteeringConversation, SteeringItem};
use serde_json::{Map, Value, json};

/// `metadata.steering.trigger_behavior` of a claimed event (seed value).
pub const TRIGGER_ABSORBED: &str = "absorbed_into_active_run";

/// An active run of a conversation, as the session store knows it: the run id and its
/// frozen snapshot (`None` when the stored session does not decode; such a run still counts
/// as active for the concurrency policy but never absorbs steering input).
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveRun {
    /// The run.
    pub run_id: RunId,
    /// Its frozen authorization.
    pub snapshot: Option<AuthorizationSnapshot>,
}

/// The run that absorbs `event` as steering input, if any (host-behaviour §11
/// `find_steering_target`):
///
/// - the event is a `message.received` with a conversation;
/// - the runner its binding resolves to declares `capabilities.steering`
///   (`runner_supports_steering`, from the current registry row);
/// - a candidate's snapshot matches *exactly* on runner, conversation, bot, workspace and
///   thread (`None` matches only `None`) and grants `steering_pull`.
///
/// Among the candidates the **oldest** run wins. Run ids are UUID v7 (time ordered, created
/// when the run is dispatched), so the smallest id is the run started first.
#[must_use]
pub fn target<'a>(
    event: &AgentEventEnvelope,
    runner_id: &RunnerId,
    runner_supports_steering: bool,
    active: &'a [ActiveRun],
) -> Option<&'a ActiveRun> {
    if event.event_type != event_types::MESSAGE_RECEIVED || !runner_supports_steering {
        return None;
    }
    let conversation = event.conversation_id.as_deref().filter(|c| !c.is_empty())?;
    active
        .iter()
        .filter(|run| {
            run.snapshot.as_ref().is_some_and(|s| {
                s.available_apis.steering_pull
                    && &s.runner_id == runner_id
                    && s.conversation_id.as_deref() == Some(conversation)
                    && s.bot_id == event.bot_id
                    && s.workspace_id == event.workspace_id
                    && s.thread_id == event.thread_id
            })
        })
        .min_by_key(|run| run.run_id)
}

/// The steering item pushed to `run_id`'s list for `event` (host-behaviour §11). The input
/// is kept whole (the runner receives what it would have received in a context); only
/// persisted copies are redacted.
#[must_use]
pub fn item(
    event: &AgentEventEnvelope,
    run_id: RunId,
    runner_id: &RunnerId,
    claimed_at: i64,
) -> SteeringItem {
    SteeringItem {
        claimed_run_id: run_id.to_string(),
        runner_id: runner_id.to_string(),
        claimed_at,
        event: event.event_context(),
        conversation: SteeringConversation {
            conversation_id: event.conversation_id.clone(),
            thread_id: event.thread_id.clone(),
            bot_id: event.bot_id.clone(),
            workspace_id: Some(event.workspace_id.to_string()),
        },
        actor: event.actor.clone(),
        subject: event.subject.clone(),
        input: event.input.clone(),
        metadata: Map::new(),
    }
}

/// `metadata.steering` of a claimed event (host-behaviour §15 step 5).
#[must_use]
pub fn claim_metadata(run_id: RunId, runner_id: &str, claimed_at: i64) -> Value {
    json!({
        "status": "queued",
        "trigger_behavior": TRIGGER_ABSORBED,
        "claimed_by_run_id": run_id.to_string(),
        "claimed_runner_id": runner_id,
        "claimed_at": claimed_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_protocol::context::{
        ActorContext, AgentInput, AgentResources, ContextAPICapabilities, DeliveryContext,
    };
    use sb_protocol::host::{RunBudgets, StatePolicy};
    use sb_protocol::ids::{EventId, WorkspaceId};

    const RUNNER: &str = "plugin:acme/agent/default";

    fn event(conversation: Option<&str>, thread: Option<&str>) -> AgentEventEnvelope {
        AgentEventEnvelope {
            event_id: EventId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_type: "message.received".into(),
            event_time: Some(1_700_000_000),
            source: "api".into(),
            source_event_type: None,
            bot_id: Some("bot".into()),
            conversation_id: conversation.map(Into::into),
            thread_id: thread.map(Into::into),
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("u1".into()),
                actor_name: Some("Alice".into()),
                metadata: Map::new(),
            }),
            subject: None,
            input: AgentInput {
                text: Some("and also this".into()),
                contents: vec![
                    serde_json::from_value(json!({"type": "image", "base64": "AAAA"})).unwrap(),
                ],
                attachments: Vec::new(),
            },
            delivery: DeliveryContext::new("api"),
            raw_ref: None,
            data: Map::new(),
            metadata: Map::new(),
        }
    }

    fn run(steering: bool, conversation: &str, thread: Option<&str>) -> ActiveRun {
        let run_id = RunId::new();
        ActiveRun {
            run_id,
            snapshot: Some(AuthorizationSnapshot {
                run_id,
                plugin_id: "acme/agent".into(),
                runner_id: RUNNER.parse().unwrap(),
                binding_id: "b".into(),
                workspace_id: WorkspaceId::default_workspace(),
                bot_id: Some("bot".into()),
                conversation_id: Some(conversation.into()),
                thread_id: thread.map(Into::into),
                actor: None,
                subject: None,
                resources: AgentResources::default(),
                available_apis: ContextAPICapabilities {
                    steering_pull: steering,
                    ..Default::default()
                },
                state_policy: StatePolicy::default(),
                budgets: RunBudgets::default(),
                deadline_at: None,
                host_api_token_sha256: None,
            }),
        }
    }

    #[test]
    fn oldest_matching_run_is_the_target() {
        let runner: RunnerId = RUNNER.parse().unwrap();
        let older = run(true, "c1", None);
        let newer = run(true, "c1", None);
        let e = event(Some("c1"), None);
        let active = [newer.clone(), older.clone()];
        assert_eq!(
            target(&e, &runner, true, &active).map(|r| r.run_id),
            Some(older.run_id)
        );
        // the current registry must still declare the capability
        assert!(target(&e, &runner, false, &active).is_none());
    }

    #[test]
    fn every_scope_field_must_match_exactly() {
        let runner: RunnerId = RUNNER.parse().unwrap();
        let e = event(Some("c1"), None);
        let none = |runs: Vec<ActiveRun>| target(&e, &runner, true, &runs).is_none();
        assert!(none(vec![run(false, "c1", None)]), "no steering_pull grant");
        assert!(none(vec![run(true, "c2", None)]), "other conversation");
        assert!(
            none(vec![run(true, "c1", Some("t1"))]),
            "thread: None ≠ Some"
        );
        let mut other_bot = run(true, "c1", None);
        other_bot.snapshot.as_mut().unwrap().bot_id = Some("bot2".into());
        assert!(none(vec![other_bot]), "other bot");
        let mut other_ws = run(true, "c1", None);
        other_ws.snapshot.as_mut().unwrap().workspace_id = WorkspaceId::new("w2").unwrap();
        assert!(none(vec![other_ws]), "other workspace");
        let mut other_runner = run(true, "c1", None);
        other_runner.snapshot.as_mut().unwrap().runner_id =
            "plugin:acme/agent/other".parse().unwrap();
        assert!(none(vec![other_runner]), "other runner");
        assert!(
            none(vec![ActiveRun {
                run_id: RunId::new(),
                snapshot: None
            }]),
            "undecodable session"
        );
        // threads match when equal
        let threaded = event(Some("c1"), Some("t1"));
        let t = run(true, "c1", Some("t1"));
        assert_eq!(
            target(&threaded, &runner, true, std::slice::from_ref(&t)).map(|r| r.run_id),
            Some(t.run_id)
        );
        // only messages with a conversation steer
        let active = [run(true, "c1", None)];
        let mut joined = event(Some("c1"), None);
        joined.event_type = "group.member_joined".into();
        assert!(target(&joined, &runner, true, &active).is_none());
        assert!(target(&event(None, None), &runner, true, &active).is_none());
        assert!(target(&event(Some(""), None), &runner, true, &active).is_none());
    }

    #[test]
    fn item_shape_is_the_protocol_one() {
        let e = event(Some("c1"), Some("t"));
        let run_id = RunId::new();
        let runner: RunnerId = RUNNER.parse().unwrap();
        let it = item(&e, run_id, &runner, 1_700_000_100);
        let v = serde_json::to_value(&it).unwrap();
        assert_eq!(v["claimed_run_id"], run_id.to_string());
        assert_eq!(v["runner_id"], RUNNER);
        assert_eq!(v["claimed_at"], 1_700_000_100);
        assert_eq!(v["event"]["event_id"], e.event_id.to_string());
        assert_eq!(v["event"]["event_type"], "message.received");
        assert_eq!(
            v["conversation"],
            json!({"conversation_id": "c1", "thread_id": "t", "bot_id": "bot", "workspace_id": "default"})
        );
        assert_eq!(v["actor"]["actor_id"], "u1");
        assert_eq!(v["input"]["text"], "and also this");
        assert_eq!(
            v["input"]["contents"][0]["base64"], "AAAA",
            "the runner gets the input whole"
        );
        let back: SteeringItem = serde_json::from_value(v).unwrap();
        assert_eq!(back, it);

        let m = claim_metadata(run_id, RUNNER, 5);
        assert_eq!(m["status"], "queued");
        assert_eq!(m["trigger_behavior"], "absorbed_into_active_run");
        assert_eq!(m["claimed_by_run_id"], run_id.to_string());
        assert_eq!(m["claimed_runner_id"], RUNNER);
    }

    #[test]
    fn an_item_gives_a_keyed_redacted_dropped_row() {
        // The item this module builds is what `sb_store::audit` reads back when the run
        // ends without pulling it (the builder itself is tested in sb-store).
        let e = event(Some("c1"), None);
        let run_id = RunId::new();
        let runner: RunnerId = RUNNER.parse().unwrap();
        let v = serde_json::to_value(item(&e, run_id, &runner, 42)).unwrap();
        let ws = WorkspaceId::default_workspace();
        let row = sb_store::audit::steering_dropped(
            &v,
            run_id,
            RUNNER,
            &ws,
            sb_store::audit::DROPPED_RUN_ENDED,
        );
        assert_eq!(
            row.idempotency_key,
            Some(format!("steering.dropped:{run_id}:{}", e.event_id))
        );
        assert_eq!(row.conversation_id.as_deref(), Some("c1"));
        assert_eq!(row.actor_id.as_deref(), Some("u1"));
        assert_eq!(row.input_summary.as_deref(), Some("and also this"));
        assert_eq!(row.metadata["steering"]["claimed_at"], 42);
        let input = &row.envelope.as_ref().unwrap()["input"];
        assert_eq!(input["contents"][0]["content_redacted"], true);
    }
}
