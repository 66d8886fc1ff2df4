//! The shared per-conversation state behind steering and the concurrency policy, kept in
//! the session store so that every orchestrator process sees the same (SPEC §7):
//!
//! ```text
//! <kv prefix>set:conv-active:<conversation>   run ids whose session was written   (active index)
//! <kv prefix>set:conv-parked:<conversation>   parked events, sorted = arrival order (enqueue FIFO)
//! <kv prefix>set:conv-parked-index            conversations that may have parked events
//! ```
//!
//! # Active index
//! The event consumer adds a run right after writing its session; the result sink removes it
//! when it applies the run's terminal item (every terminal passes through the sink, the
//! reaper's included). A member counts as active only while its session exists, so a run
//! whose worker ended it, or whose session expired, stops counting at once; readers prune
//! such members.
//!
//! # Waking the parked queue
//! [`Conversations::kick`] publishes the head of the parked queue back to the events exchange
//! when no run of the conversation is active. Both sides of the race call it after their own
//! write: the sink after removing a finished run ([`Conversations::finish_run`], whose
//! removal and first read of the parked queue are one store step), the consumer after parking
//! an event. With linearizable store operations one of the two sees the other's write, so a
//! parked event cannot be stranded; a head published twice is harmless (routing is
//! idempotent per event).
//! The reaper also sweeps [`PARKED_CONVERSATIONS_SET`] as a safety net (e.g. a run whose
//! session expired without a terminal item).

use std::sync::Arc;
use std::time::Duration;

use sb_common::bus::topology::Topology;
use sb_common::bus::{Bus, PublishOptions};
use sb_common::session::SessionStore;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::ids::RunId;

use crate::concurrency::{ConversationKey, PARKED_CONVERSATIONS_SET, member_event};
use crate::error::Result;
use crate::steering::ActiveRun;

/// Reads and writes the per-conversation state (see the module docs).
#[derive(Clone)]
pub struct Conversations {
    sessions: Arc<dyn SessionStore>,
    bus: Arc<dyn Bus>,
    topology: Topology,
    /// Lower bound of the active index's TTL (each add resets it to
    /// `max(index_ttl, session_ttl)`), so a conversation nobody finishes cleanly does not
    /// keep its index forever.
    index_ttl: Duration,
}

impl std::fmt::Debug for Conversations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conversations")
            .field("index_ttl", &self.index_ttl)
            .finish_non_exhaustive()
    }
}

impl Conversations {
    /// Conversation state over `sessions`, waking parked events through `bus`.
    #[must_use]
    pub fn new(
        sessions: Arc<dyn SessionStore>,
        bus: Arc<dyn Bus>,
        topology: Topology,
        index_ttl: Duration,
    ) -> Self {
        Self {
            sessions,
            bus,
            topology,
            index_ttl,
        }
    }

    /// The conversation's active runs, oldest first, except `exclude` (the event's own run);
    /// members without a session are pruned.
    pub async fn active(
        &self,
        key: &ConversationKey,
        exclude: Option<RunId>,
    ) -> Result<Vec<ActiveRun>> {
        let set = key.active_set();
        let mut active = Vec::new();
        for member in self.sessions.set_members(&set).await? {
            let Ok(run_id) = member.parse::<RunId>() else {
                self.sessions.set_remove(&set, &member).await?;
                continue;
            };
            if Some(run_id) == exclude {
                continue;
            }
            match self.sessions.get_session(&run_id).await? {
                Some(session) => active.push(ActiveRun {
                    run_id,
                    snapshot: serde_json::from_value::<AuthorizationSnapshot>(session).ok(),
                }),
                None => {
                    // Ended (or expired) without the sink having seen its terminal yet.
                    self.sessions.set_remove(&set, &member).await?;
                }
            }
        }
        active.sort_by_key(|r| r.run_id);
        Ok(active)
    }

    /// Writes a run's session (`session_ttl`) and then adds the run to the active index
    /// (which lives at least as long as the session), in one step of the session store: the
    /// run is visible to steering and concurrency only once its session exists.
    pub async fn put_session_and_add_run(
        &self,
        key: &ConversationKey,
        run_id: RunId,
        session: &serde_json::Value,
        session_ttl: Duration,
    ) -> Result<()> {
        let ttl = self.index_ttl.max(session_ttl);
        self.sessions
            .put_session_and_add(
                &run_id,
                session,
                session_ttl,
                &key.active_set(),
                &run_id.to_string(),
                Some(ttl),
            )
            .await?;
        Ok(())
    }

    /// Removes a finished run.
    pub async fn remove_run(&self, key: &ConversationKey, run_id: RunId) -> Result<()> {
        self.sessions
            .set_remove(&key.active_set(), &run_id.to_string())
            .await?;
        Ok(())
    }

    /// The parked members, sorted (= arrival order).
    pub async fn parked(&self, key: &ConversationKey) -> Result<Vec<String>> {
        Ok(self.sessions.set_members(&key.parked_set()).await?)
    }

    /// Parks `member` (idempotent) and records the conversation for the reaper's sweep.
    pub async fn park(&self, key: &ConversationKey, member: &str) -> Result<()> {
        // No TTL: a parked event leaves the set when it is routed, never by expiry.
        self.sessions
            .set_add(&key.parked_set(), member, None)
            .await?;
        self.sessions
            .set_add(PARKED_CONVERSATIONS_SET, &key.encode(), None)
            .await?;
        Ok(())
    }

    /// Removes `member` from the parked queue; `true` if it was there.
    pub async fn unpark(&self, key: &ConversationKey, member: &str) -> Result<bool> {
        Ok(self.sessions.set_remove(&key.parked_set(), member).await?)
    }

    /// Removes a finished run, then [kicks](Self::kick) the parked queue, the removal and the
    /// read of the queue in one store round trip (the read still follows the removal, as the
    /// race in the module docs needs). Returns whether it published.
    pub async fn finish_run(&self, key: &ConversationKey, run_id: RunId) -> Result<bool> {
        let (_, parked) = self
            .sessions
            .set_remove_then_members(&key.active_set(), &run_id.to_string(), &key.parked_set())
            .await?;
        self.release_head(key, parked).await
    }

    /// If the conversation has parked events and no active run, publishes the head's event
    /// message so it is routed (again). Returns whether it published.
    pub async fn kick(&self, key: &ConversationKey) -> Result<bool> {
        let parked = self.parked(key).await?;
        self.release_head(key, parked).await
    }

    /// [`kick`](Self::kick) with the parked members as just read.
    async fn release_head(&self, key: &ConversationKey, parked: Vec<String>) -> Result<bool> {
        let mut event_id = None;
        for member in parked {
            match member_event(&member) {
                Some(id) => {
                    event_id = Some(id);
                    break;
                }
                // Not ours; drop it rather than block the queue.
                None => {
                    self.unpark(key, &member).await?;
                }
            }
        }
        let Some(event_id) = event_id else {
            return Ok(false);
        };
        if !self.active(key, None).await?.is_empty() {
            return Ok(false);
        }
        let announcement =
            self.topology
                .event_announcement(&key.workspace, event_id, Some(&key.conversation));
        self.bus
            .publish(
                &announcement.exchange,
                &announcement.routing_key,
                announcement.body.into(),
                PublishOptions::default(),
            )
            .await?;
        Metrics::global().inc(names::BUS_PUBLISHED_TOTAL, &[("exchange", "events")]);
        tracing::debug!(event_id = %event_id, conversation = %key.conversation, "parked event released");
        Ok(true)
    }

    /// Safety net run by the reaper: kicks every conversation that may have parked events,
    /// and forgets those whose queue is empty. Returns how many heads were published.
    pub async fn sweep(&self) -> Result<usize> {
        let mut published = 0;
        for encoded in self.sessions.set_members(PARKED_CONVERSATIONS_SET).await? {
            let Some(key) = ConversationKey::decode(&encoded) else {
                self.sessions
                    .set_remove(PARKED_CONVERSATIONS_SET, &encoded)
                    .await?;
                continue;
            };
            if self.parked(&key).await?.is_empty() {
                self.sessions
                    .set_remove(PARKED_CONVERSATIONS_SET, &encoded)
                    .await?;
                // An event parked meanwhile re-adds the key after its member; look again so
                // the removal cannot hide it.
                if !self.parked(&key).await?.is_empty() {
                    self.sessions
                        .set_add(PARKED_CONVERSATIONS_SET, &encoded, None)
                        .await?;
                }
                continue;
            }
            if self.kick(&key).await? {
                published += 1;
            }
        }
        Ok(published)
    }
}
