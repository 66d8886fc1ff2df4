//! The conversation concurrency policy as data (SPEC §7, `delivery_policy.concurrency`):
//! what happens to an event of a conversation that already has active runs and whose
//! message no active run absorbed as steering input. Pure; the `conversations` module keeps
//! the shared state and the event consumer (`events`) applies the [`Action`]; both use this
//! module, which uses neither.
//!
//! | policy | no active run, nothing parked | otherwise |
//! | --- | --- | --- |
//! | `parallel` (default) | start | start alongside |
//! | `enqueue` | start | park; started when the active runs ended, in arrival order |
//! | `interrupt` | start | cancel the active runs, then start |
//! | `reject` | start | event `rejected`, reason `conversation.busy` |
//!
//! # The parked queue (`enqueue`)
//!
//! Parked events stay `received` in the event log, with `metadata.concurrency` saying whom
//! they wait for; the conversation's FIFO is a set in the session store whose members sort
//! in arrival order ([`parked_member`]: the park time in microseconds, then the event id).
//! An event may start only when no run is active **and** no parked event is ahead of it, so
//! a message arriving while the head is being released waits behind it.

use sb_protocol::host::ConcurrencyPolicy;
use sb_protocol::ids::{EventId, RunId, WorkspaceId};
use serde_json::Value;

/// `reason` of an event refused by the `reject` policy.
pub const REJECT_REASON: &str = "conversation.busy";
/// `metadata.concurrency.status` of a parked event.
pub const STATUS_QUEUED: &str = "queued";
/// `metadata.concurrency.status` of a formerly parked event once its run started.
pub const STATUS_STARTED: &str = "started";

/// A conversation: the unit of the concurrency policy and of the active-run index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConversationKey {
    /// Workspace.
    pub workspace: WorkspaceId,
    /// Conversation id (non-empty).
    pub conversation: String,
}

impl ConversationKey {
    /// The key of `conversation` in `workspace`; `None` for a missing or empty conversation
    /// (such events have no concurrency policy and no steering).
    #[must_use]
    pub fn new(workspace: &WorkspaceId, conversation: Option<&str>) -> Option<Self> {
        let conversation = conversation.filter(|c| !c.is_empty())?;
        Some(Self {
            workspace: workspace.clone(),
            conversation: conversation.to_owned(),
        })
    }

    /// Unambiguous text form `<len(workspace)>:<workspace>:<conversation>` (workspace ids
    /// may contain `:`; conversation ids may contain anything).
    #[must_use]
    pub fn encode(&self) -> String {
        let ws = self.workspace.as_str();
        format!("{}:{ws}:{}", ws.len(), self.conversation)
    }

    /// Parses [`encode`](Self::encode)'s form.
    #[must_use]
    pub fn decode(text: &str) -> Option<Self> {
        let (len, rest) = text.split_once(':')?;
        let len: usize = len.parse().ok()?;
        let ws = rest.get(..len)?;
        let conversation = rest.get(len..)?.strip_prefix(':')?;
        Self::new(&WorkspaceId::new(ws).ok()?, Some(conversation))
    }

    /// Session-store set of the conversation's active runs.
    #[must_use]
    pub fn active_set(&self) -> String {
        format!("conv-active:{}", self.encode())
    }

    /// Session-store set of the conversation's parked events.
    #[must_use]
    pub fn parked_set(&self) -> String {
        format!("conv-parked:{}", self.encode())
    }
}

/// Reason given to the runs an `interrupt` event cancels.
#[must_use]
pub fn interrupt_reason(event_id: &EventId) -> String {
    format!("interrupted by event {event_id} of the conversation")
}

/// Session-store set of every conversation that may have parked events (members:
/// [`ConversationKey::encode`]); the reaper sweeps it so a lost wake-up cannot strand a
/// queue.
pub const PARKED_CONVERSATIONS_SET: &str = "conv-parked-index";

/// What to do with an event the steering claim did not absorb.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start a run now.
    Start,
    /// Park the event (status stays `received`) until the runs in `behind` (and any event
    /// parked ahead of it) are done.
    Park {
        /// The active runs it waits for (empty when it only waits for parked events).
        behind: Vec<RunId>,
    },
    /// Cancel these runs, then start.
    Interrupt {
        /// The runs to cancel.
        cancel: Vec<RunId>,
    },
    /// Refuse the event (`rejected`, reason [`REJECT_REASON`]).
    Reject {
        /// The active runs that made it busy.
        active: Vec<RunId>,
    },
}

/// Decides with the agent's `policy`, the conversation's active runs (never the event's own
/// run) and whether a parked event is ahead of this one (only `enqueue` looks at it).
#[must_use]
pub fn decide(policy: ConcurrencyPolicy, active: &[RunId], parked_ahead: bool) -> Action {
    match policy {
        ConcurrencyPolicy::Parallel => Action::Start,
        ConcurrencyPolicy::Enqueue if active.is_empty() && !parked_ahead => Action::Start,
        ConcurrencyPolicy::Enqueue => Action::Park {
            behind: active.to_vec(),
        },
        ConcurrencyPolicy::Interrupt if active.is_empty() => Action::Start,
        ConcurrencyPolicy::Interrupt => Action::Interrupt {
            cancel: active.to_vec(),
        },
        ConcurrencyPolicy::Reject if active.is_empty() => Action::Start,
        ConcurrencyPolicy::Reject => Action::Reject {
            active: active.to_vec(),
        },
    }
}

/// Whether deciding for an event needs the conversation's active runs: for every policy
/// but `parallel` (which starts whatever runs), and when the event may steer an active run.
/// A `parallel` agent whose runner cannot be steered skips the read (a session-store round
/// trip per member) on every event.
#[must_use]
pub fn needs_active_runs(policy: ConcurrencyPolicy, may_steer: bool) -> bool {
    policy != ConcurrencyPolicy::Parallel || may_steer
}

/// The parked-set member of an event parked at `parked_at_micros` (epoch): zero-padded so
/// that the set's sorted order is arrival order.
#[must_use]
pub fn parked_member(parked_at_micros: i64, event_id: EventId) -> String {
    format!("{:020}:{event_id}", parked_at_micros.max(0))
}

/// The event of a parked-set member.
#[must_use]
pub fn member_event(member: &str) -> Option<EventId> {
    member.rsplit_once(':')?.1.parse().ok()
}

/// The parked-set member recorded in an event's metadata (`metadata.concurrency.ticket`),
/// i.e. whether it was parked before. It is written *before* the member is added, so every
/// member's event carries it.
#[must_use]
pub fn recorded_member(metadata: &Value) -> Option<String> {
    metadata
        .pointer("/concurrency/ticket")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// Whether a parked event is ahead of this one: for a parked event (`own = Some`), any
/// member sorting before its own; for a new event, any member at all. `parked` is sorted.
#[must_use]
pub fn parked_ahead(parked: &[String], own: Option<&str>) -> bool {
    match own {
        Some(own) => parked.iter().any(|m| m.as_str() < own),
        None => !parked.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_parallel_without_steering_skips_the_active_runs() {
        assert!(!needs_active_runs(ConcurrencyPolicy::Parallel, false));
        assert!(needs_active_runs(ConcurrencyPolicy::Parallel, true));
        for policy in [
            ConcurrencyPolicy::Enqueue,
            ConcurrencyPolicy::Interrupt,
            ConcurrencyPolicy::Reject,
        ] {
            assert!(needs_active_runs(policy, false));
        }
    }

    #[test]
    fn policies() {
        let a = RunId::new();
        let b = RunId::new();
        let busy = [a, b];
        for policy in [
            ConcurrencyPolicy::Parallel,
            ConcurrencyPolicy::Enqueue,
            ConcurrencyPolicy::Interrupt,
            ConcurrencyPolicy::Reject,
        ] {
            assert_eq!(decide(policy, &[], false), Action::Start, "{policy:?} idle");
        }
        assert_eq!(
            decide(ConcurrencyPolicy::Parallel, &busy, true),
            Action::Start
        );
        assert_eq!(
            decide(ConcurrencyPolicy::Enqueue, &busy, false),
            Action::Park {
                behind: busy.to_vec()
            }
        );
        assert_eq!(
            decide(ConcurrencyPolicy::Enqueue, &[], true),
            Action::Park { behind: vec![] },
            "behind an earlier parked event"
        );
        assert_eq!(
            decide(ConcurrencyPolicy::Interrupt, &busy, true),
            Action::Interrupt {
                cancel: busy.to_vec()
            }
        );
        assert_eq!(
            decide(ConcurrencyPolicy::Reject, &[a], false),
            Action::Reject { active: vec![a] }
        );
        // only enqueue waits for parked events
        assert_eq!(decide(ConcurrencyPolicy::Reject, &[], true), Action::Start);
        assert_eq!(
            decide(ConcurrencyPolicy::Interrupt, &[], true),
            Action::Start
        );
    }

    #[test]
    fn keys_roundtrip_and_do_not_collide() {
        let k = ConversationKey::new(&WorkspaceId::new("a:b").unwrap(), Some("c:d")).unwrap();
        assert_eq!(k.encode(), "3:a:b:c:d");
        assert_eq!(ConversationKey::decode(&k.encode()), Some(k.clone()));
        let other = ConversationKey::new(&WorkspaceId::new("a").unwrap(), Some("b:c:d")).unwrap();
        assert_ne!(k.encode(), other.encode());
        assert_eq!(ConversationKey::decode(&other.encode()), Some(other));
        assert_eq!(k.active_set(), "conv-active:3:a:b:c:d");
        assert_eq!(k.parked_set(), "conv-parked:3:a:b:c:d");
        assert!(ConversationKey::new(&WorkspaceId::default_workspace(), Some("")).is_none());
        assert!(ConversationKey::new(&WorkspaceId::default_workspace(), None).is_none());
        for bad in ["", "x", "9:ab:c", "1:a", "1:ab", "0::c"] {
            assert_eq!(ConversationKey::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn parked_members_sort_in_arrival_order() {
        let e1 = EventId::new();
        let e2 = EventId::new();
        let first = parked_member(9_999, e2);
        let second = parked_member(10_000, e1);
        assert!(first < second, "time first, whatever the event ids");
        assert_eq!(member_event(&first), Some(e2));
        assert_eq!(member_event("garbage"), None);
        let parked = vec![first.clone(), second.clone()];
        assert!(!parked_ahead(&parked, Some(&first)));
        assert!(parked_ahead(&parked, Some(&second)));
        assert!(parked_ahead(&parked, None));
        assert!(!parked_ahead(&[], None));
        let meta = serde_json::json!({"concurrency": {"ticket": first}});
        assert_eq!(recorded_member(&meta), Some(first));
        assert_eq!(recorded_member(&serde_json::json!({})), None);
    }
}
