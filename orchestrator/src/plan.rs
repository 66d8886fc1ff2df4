//! Routing decisions as data (STYLE §3.8): what to do with one event, given the binding
//! resolution and the runner registry. The event consumer looks things up, asks these
//! functions, and applies the answer; nothing here does I/O.
//!
//! ```text
//! event ──resolve──▶ Resolution ──plan(+ registry row)──▶ Plan
//!                                                          ├─ Unrouted { reason }   → event `unrouted`, ack
//!                                                          └─ Dispatch { binding, descriptor, pool }
//!                                                                 │ + access, cursor, state, clock
//!                                                                 ▼
//!                                      authorization() → frozen snapshot
//!                                                                 ▼
//!                                                        prepare() → Prepared run
//!                                                       (snapshot, job with its context, session TTL)
//! ```

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sb_protocol::host::{
    ActorRef, AgentBinding, AgentEventEnvelope, AgentRunnerDescriptor, AuthorizationSnapshot,
    RunBudgets, SubjectRef, host_api_token,
};
use sb_protocol::ids::RunId;
use sb_protocol::messages::{RunFacts, RunJob};
use sb_rules::bindings::Resolution;
use serde_json::{Value, json};

use crate::access::EffectiveAccess;
use crate::context::{self, ContextInputs};

/// Why an event starts no run. The text is stored as the event's `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnroutedReason {
    /// No agent handles the event.
    BindingNotFound,
    /// Several agents tie at the most specific scope.
    BindingAmbiguous,
    /// The agent the event names cannot handle it (disabled, deleted, another workspace or
    /// not subscribed to the event type since it was ingested).
    TargetUnavailable,
    /// The winning agent's runner is not registered by any worker (or its descriptor is
    /// unreadable).
    RunnerNotFound,
}

impl UnroutedReason {
    /// `binding.not_found`, `binding.ambiguous`, `binding.target_unavailable`,
    /// `runner.not_found`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::BindingNotFound => "binding.not_found",
            Self::BindingAmbiguous => "binding.ambiguous",
            Self::TargetUnavailable => "binding.target_unavailable",
            Self::RunnerNotFound => "runner.not_found",
        }
    }
}

impl std::fmt::Display for UnroutedReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The decision for one event.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Record the event as `unrouted` with `reason`; `metadata` is merged into the event's
    /// metadata (`{"routing": {...}}`) so operators can see why.
    Unrouted {
        /// The reason code.
        reason: UnroutedReason,
        /// Merged into the event metadata.
        metadata: Value,
    },
    /// Start a run of `descriptor` for `binding` on `pool`.
    Dispatch(Box<Dispatch>),
}

/// A run to start.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    /// The winning binding.
    pub binding: AgentBinding,
    /// Its runner.
    pub descriptor: AgentRunnerDescriptor,
    /// Worker pool of the runner.
    pub pool: String,
}

/// What the registry knows about the winning binding's runner.
#[derive(Debug, Clone, PartialEq)]
pub enum RunnerLookup {
    /// Registered, with its descriptor and pool.
    Found {
        /// Descriptor.
        descriptor: Box<AgentRunnerDescriptor>,
        /// Pool.
        pool: String,
    },
    /// No row for the runner id.
    Missing,
    /// A row exists but its descriptor does not decode.
    Invalid(String),
}

/// Decides what to do with an event from the binding resolution and the registry lookup of
/// the winner's runner (`runner` is only consulted for a match).
#[must_use]
pub fn plan(resolution: Resolution, runner: impl FnOnce(&AgentBinding) -> RunnerLookup) -> Plan {
    match resolution {
        Resolution::NotFound => Plan::Unrouted {
            reason: UnroutedReason::BindingNotFound,
            metadata: json!({"routing": {"reason": UnroutedReason::BindingNotFound.as_str()}}),
        },
        Resolution::Ambiguous(ids) => Plan::Unrouted {
            reason: UnroutedReason::BindingAmbiguous,
            metadata: json!({"routing": {
                "reason": UnroutedReason::BindingAmbiguous.as_str(),
                "binding_ids": ids,
            }}),
        },
        Resolution::TargetUnavailable(agent_id) => Plan::Unrouted {
            reason: UnroutedReason::TargetUnavailable,
            metadata: json!({"routing": {
                "reason": UnroutedReason::TargetUnavailable.as_str(),
                "agent_id": agent_id.to_string(),
            }}),
        },
        Resolution::Matched(binding) => match runner(&binding) {
            RunnerLookup::Found { descriptor, pool } => Plan::Dispatch(Box::new(Dispatch {
                binding: *binding,
                descriptor: *descriptor,
                pool,
            })),
            RunnerLookup::Missing => Plan::Unrouted {
                reason: UnroutedReason::RunnerNotFound,
                metadata: json!({"routing": {
                    "reason": UnroutedReason::RunnerNotFound.as_str(),
                    "binding_id": binding.binding_id,
                    "runner_id": binding.runner_id.to_string(),
                }}),
            },
            RunnerLookup::Invalid(error) => Plan::Unrouted {
                reason: UnroutedReason::RunnerNotFound,
                metadata: json!({"routing": {
                    "reason": UnroutedReason::RunnerNotFound.as_str(),
                    "binding_id": binding.binding_id,
                    "runner_id": binding.runner_id.to_string(),
                    "error": error,
                }}),
            },
        },
    }
}

/// Inputs gathered by the service for a [`Dispatch`].
#[derive(Debug, Clone)]
pub struct PrepareInputs {
    /// The run id: fresh for a new run, the existing one when the event was redelivered.
    pub run_id: RunId,
    /// Now, epoch seconds.
    pub now_epoch_secs: f64,
    /// The run's deadline (epoch seconds), fixed when the run was first created.
    pub deadline_at: Option<f64>,
    /// Effective access.
    pub access: EffectiveAccess,
    /// Latest transcript cursor of the conversation.
    pub latest_cursor: Option<String>,
    /// State snapshot.
    pub state: sb_protocol::context::AgentRunState,
    /// Host version.
    pub host_version: String,
    /// The deployment's per-run budgets; the agent's own budgets override them.
    pub default_budgets: RunBudgets,
    /// Extra session lifetime past the deadline.
    pub session_grace: Duration,
    /// Session lifetime of a run without a deadline.
    pub no_deadline_session_ttl: Duration,
    /// The run's remote Host API token, minted by the caller (randomness is not a decision):
    /// handed to the runner in the context, frozen into the snapshot as its digest only.
    pub host_api_token: Option<String>,
    /// When the event was accepted (epoch milliseconds), carried on the job so the worker
    /// can measure ingest-to-first-result latency.
    pub accepted_at_ms: Option<i64>,
}

/// Everything the consumer writes and publishes for a dispatched run.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The frozen authorization (session store value, and kept on the event).
    pub snapshot: AuthorizationSnapshot,
    /// The job for `switchboard.runs.<pool>`, with the run's context (its one copy).
    pub job: RunJob,
    /// How long the session lives: until the deadline plus grace.
    pub session_ttl: Duration,
}

/// The frozen authorization of a run ([`Prepared::snapshot`]): what `inputs` say besides
/// the transcript cursor and the state, which only the context holds. The router writes it
/// onto the event with the run's start, before the start's reads are answered.
#[must_use]
pub fn authorization(
    event: &AgentEventEnvelope,
    dispatch: &Dispatch,
    inputs: &PrepareInputs,
) -> AuthorizationSnapshot {
    AuthorizationSnapshot {
        run_id: inputs.run_id,
        plugin_id: dispatch.descriptor.plugin_id(),
        runner_id: dispatch.binding.runner_id.clone(),
        binding_id: dispatch.binding.binding_id.clone(),
        workspace_id: event.workspace_id.clone(),
        bot_id: event.bot_id.clone(),
        conversation_id: event.conversation_id.clone(),
        thread_id: event.thread_id.clone(),
        actor: event.actor.as_ref().map(|a| ActorRef {
            actor_type: a.actor_type.clone(),
            actor_id: a.actor_id.clone(),
        }),
        subject: event.subject.as_ref().map(|s| SubjectRef {
            subject_type: s.subject_type.clone(),
            subject_id: s.subject_id.clone(),
        }),
        resources: inputs.access.resources.clone(),
        available_apis: inputs.access.available_apis,
        state_policy: dispatch.binding.state_policy.clone(),
        budgets: dispatch.binding.budgets.over(inputs.default_budgets),
        deadline_at: inputs.deadline_at,
        host_api_token_sha256: inputs.host_api_token.as_deref().map(host_api_token::digest),
    }
}

/// Builds the context and the job of a run whose frozen authorization is `snapshot`
/// ([`authorization`] of the same `inputs`: the router builds it once, before the run's
/// start writes it onto the event, and the cursor and the state it fills in afterwards are
/// not part of it).
#[must_use]
pub fn prepare(
    event: &AgentEventEnvelope,
    dispatch: &Dispatch,
    inputs: PrepareInputs,
    snapshot: AuthorizationSnapshot,
) -> Prepared {
    let PrepareInputs {
        run_id,
        now_epoch_secs,
        deadline_at,
        access,
        latest_cursor,
        state,
        host_version,
        default_budgets: _,
        session_grace,
        no_deadline_session_ttl,
        host_api_token,
        accepted_at_ms,
    } = inputs;

    let context = context::build(
        event,
        &dispatch.binding,
        ContextInputs {
            run_id,
            now_epoch_secs,
            deadline_at,
            latest_cursor,
            access,
            state,
            host_version,
            host_api_token,
        },
    );
    let mut job = RunJob::new(
        event.workspace_id.clone(),
        dispatch.binding.runner_id.clone(),
        dispatch.pool.clone(),
        context,
    );
    job.accepted_at_ms = accepted_at_ms;
    // What the run row holds (`dispatch` creates it from the same event and binding).
    job.run = Some(RunFacts {
        event_id: event.event_id,
        runner_id: dispatch.binding.runner_id.to_string(),
        thread_id: event.thread_id.clone(),
        bot_id: event.bot_id.clone(),
    });
    Prepared {
        snapshot,
        job,
        session_ttl: session_ttl(
            now_epoch_secs,
            deadline_at,
            session_grace,
            no_deadline_session_ttl,
        ),
    }
}

/// Session lifetime: until `deadline + grace` (at least `grace`, so a run created right at
/// its deadline still gets a session the reaper can end); `no_deadline` without a deadline.
#[must_use]
pub fn session_ttl(
    now: f64,
    deadline_at: Option<f64>,
    grace: Duration,
    no_deadline: Duration,
) -> Duration {
    match deadline_at {
        Some(deadline) => {
            let remaining =
                Duration::try_from_secs_f64((deadline - now).max(0.0)).unwrap_or(Duration::ZERO);
            remaining + grace.max(Duration::from_millis(1))
        }
        None => no_deadline,
    }
}

/// Epoch seconds → UTC timestamp (millisecond precision).
#[must_use]
pub fn epoch_to_utc(secs: f64) -> Option<DateTime<Utc>> {
    Utc.timestamp_millis_opt((secs * 1000.0).round() as i64)
        .single()
}

/// UTC timestamp → epoch seconds.
#[must_use]
pub fn utc_to_epoch(at: DateTime<Utc>) -> f64 {
    at.timestamp_millis() as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::tests::{binding, descriptor};
    use crate::access::{ExistingResources, effective_access};
    use sb_protocol::context::{ActorContext, AgentInput, AgentRunState, DeliveryContext};
    use sb_protocol::ids::{EventId, WorkspaceId};

    fn event() -> AgentEventEnvelope {
        AgentEventEnvelope {
            event_id: EventId::new(),
            workspace_id: WorkspaceId::default_workspace(),
            event_type: "message.received".into(),
            event_time: Some(10),
            source: "api".into(),
            source_event_type: None,
            bot_id: Some("bot".into()),
            conversation_id: Some("c1".into()),
            thread_id: None,
            actor: Some(ActorContext {
                actor_type: "user".into(),
                actor_id: Some("u1".into()),
                actor_name: None,
                metadata: Default::default(),
            }),
            subject: None,
            input: AgentInput {
                text: Some("hi".into()),
                ..Default::default()
            },
            delivery: DeliveryContext::new("api"),
            raw_ref: None,
            data: Default::default(),
            metadata: Default::default(),
        }
    }

    #[test]
    fn unrouted_reasons() {
        let p = plan(Resolution::NotFound, |_| panic!("registry not consulted"));
        assert!(matches!(
            p,
            Plan::Unrouted {
                reason: UnroutedReason::BindingNotFound,
                ..
            }
        ));
        let p = plan(
            Resolution::Ambiguous(vec!["a".into(), "b".into()]),
            |_| panic!(),
        );
        let Plan::Unrouted { reason, metadata } = p else {
            panic!()
        };
        assert_eq!(reason.as_str(), "binding.ambiguous");
        assert_eq!(metadata["routing"]["binding_ids"], json!(["a", "b"]));
        let agent_id = sb_protocol::ids::AgentId::new();
        let p = plan(Resolution::TargetUnavailable(agent_id), |_| panic!());
        let Plan::Unrouted { reason, metadata } = p else {
            panic!()
        };
        assert_eq!(reason.as_str(), "binding.target_unavailable");
        assert_eq!(metadata["routing"]["agent_id"], agent_id.to_string());
        let b = binding(json!({}), json!({}));
        let p = plan(Resolution::Matched(Box::new(b.clone())), |_| {
            RunnerLookup::Missing
        });
        let Plan::Unrouted { reason, metadata } = p else {
            panic!()
        };
        assert_eq!(reason.to_string(), "runner.not_found");
        assert_eq!(
            metadata["routing"]["runner_id"],
            "plugin:acme/agent/default"
        );
        let p = plan(Resolution::Matched(Box::new(b)), |_| {
            RunnerLookup::Invalid("bad".into())
        });
        assert!(matches!(
            p,
            Plan::Unrouted {
                reason: UnroutedReason::RunnerNotFound,
                ..
            }
        ));
    }

    #[test]
    fn dispatch_prepares_snapshot_context_and_job() {
        let d = descriptor(json!({"storage": ["plugin"]}), json!({}), json!([]));
        let b = binding(json!({"timeout": 60}), json!({}));
        let p = plan(Resolution::Matched(Box::new(b.clone())), |_| {
            RunnerLookup::Found {
                descriptor: Box::new(d.clone()),
                pool: "gpu".into(),
            }
        });
        let Plan::Dispatch(dispatch) = p else {
            panic!()
        };
        let e = event();
        let run_id = RunId::new();
        let access = effective_access(&d, &b, true, &ExistingResources::default());
        let inputs = PrepareInputs {
            run_id,
            now_epoch_secs: 1000.0,
            deadline_at: Some(1060.0),
            access,
            latest_cursor: None,
            state: AgentRunState::default(),
            host_version: "0.1.0".into(),
            default_budgets: RunBudgets {
                max_model_calls: 3,
                ..RunBudgets::default()
            },
            session_grace: Duration::from_secs(15),
            no_deadline_session_ttl: Duration::from_secs(86_400),
            host_api_token: Some("run-token".into()),
            accepted_at_ms: Some(999_500),
        };
        let snapshot = authorization(&e, &dispatch, &inputs);
        let prepared = prepare(&e, &dispatch, inputs, snapshot);
        assert_eq!(prepared.job.accepted_at_ms, Some(999_500));
        // The agent sets no budgets of its own: the deployment's apply.
        assert_eq!(prepared.snapshot.budgets.max_model_calls, 3);
        assert_eq!(prepared.snapshot.budgets.max_tool_calls, 32);
        assert_eq!(prepared.job.run_id, run_id);
        assert_eq!(prepared.job.pool, "gpu");
        assert_eq!(prepared.job.deadline_at_ms, Some(1_060_000));
        assert_eq!(prepared.session_ttl, Duration::from_secs(75));
        let s = &prepared.snapshot;
        assert_eq!(s.run_id, run_id);
        assert_eq!(s.plugin_id, "acme/agent");
        assert_eq!(s.binding_id, b.binding_id);
        assert_eq!(s.conversation_id.as_deref(), Some("c1"));
        assert_eq!(s.actor.as_ref().unwrap().actor_id.as_deref(), Some("u1"));
        assert_eq!(s.deadline_at, Some(1060.0));
        assert_eq!(
            s.resources, prepared.job.context.resources,
            "one source for both projections"
        );
        assert_eq!(
            s.available_apis,
            prepared.job.context.context.available_apis
        );
        assert!(s.resources.storage.plugin_storage && s.available_apis.storage);
        // the runner gets the token, the session only its digest
        assert_eq!(
            prepared.job.context.runtime.metadata["host_api"]["token"],
            "run-token"
        );
        assert_eq!(
            s.host_api_token_sha256.as_deref(),
            Some(host_api_token::digest("run-token").as_str())
        );
        assert!(s.accepts_host_api_token("run-token"));
        assert!(!serde_json::to_string(s).unwrap().contains("\"run-token\""));
    }

    #[test]
    fn session_ttls() {
        let g = Duration::from_secs(15);
        let n = Duration::from_secs(3600);
        assert_eq!(
            session_ttl(100.0, Some(400.0), g, n),
            Duration::from_secs(315)
        );
        assert_eq!(
            session_ttl(100.0, Some(50.0), g, n),
            g,
            "past deadline: grace only"
        );
        assert_eq!(session_ttl(100.0, None, g, n), n);
        assert_eq!(
            session_ttl(100.0, Some(100.0), Duration::ZERO, n),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn time_conversions() {
        let t = epoch_to_utc(1_700_000_000.25).unwrap();
        assert_eq!(t.timestamp_millis(), 1_700_000_000_250);
        assert_eq!(utc_to_epoch(t), 1_700_000_000.25);
    }
}
