//! Step 3 of a batch: the side effects of one stored item (assistant transcript, state,
//! artifact, run status), all idempotent (see the [module docs](super)).

use sb_common::telemetry::{Metrics, names};
use sb_protocol::content::Message;
use sb_protocol::messages::ResultMessage;
use sb_protocol::result::{AgentRunResult, ArtifactCreated, StateUpdated};
use sb_store::{RunOutcome, StoreError};

use super::{ResultSink, Written, make_room};
use crate::concurrency::ConversationKey;
use crate::deps::OrchestratorDeps;
use crate::error::Result;
use crate::journal::{self, Effect, ItemPlan, RunInfo};
use crate::lock;

impl ResultSink {
    /// Applies the side effects of one stored item, as `plan`ned
    /// ([`journal::plan_item`]), except what its insert already `written` (see the module
    /// docs).
    pub(super) async fn apply(
        &self,
        info: &RunInfo,
        message: &ResultMessage,
        plan: &ItemPlan,
        written: Written,
    ) -> Result<()> {
        Metrics::global().inc(
            names::RUN_RESULTS_TOTAL,
            &[("type", result_type_label(&message.result))],
        );
        {
            let mut applied = lock(&self.applied);
            make_room(&mut applied, &info.run_id);
            applied.entry(info.run_id).or_default().note(
                &info.run_id,
                message.sequence,
                &plan.effect,
            );
        }
        match &plan.effect {
            Effect::None => {}
            Effect::AssistantMessage(m) if !written.transcribed => {
                self.write_assistant(info, message.sequence, m).await?;
            }
            Effect::AssistantMessage(_) => {}
            Effect::State(update) => self.apply_state(info, update).await?,
            Effect::Artifact(created) => {
                self.store_artifact(info, message.sequence, created).await?
            }
        }
        if let Some(outcome) = &plan.outcome {
            self.finish(info, outcome.clone(), written.ended).await?;
        }
        Ok(())
    }

    async fn write_assistant(
        &self,
        info: &RunInfo,
        sequence: u64,
        message: &Message,
    ) -> Result<()> {
        if info.conversation_id.is_none() {
            return Ok(());
        }
        let known = lock(&self.applied)
            .get(&info.run_id)
            .and_then(|applied| applied.artifact_refs_before(sequence));
        let refs = match known {
            Some(refs) => refs,
            None => {
                let items = self.stored_items(info.run_id).await?;
                journal::artifact_refs_before(&info.run_id, &items, sequence)
            }
        };
        if let Some(row) = journal::assistant_transcript(info, message, refs) {
            append_once(&self.deps, row).await?;
        }
        Ok(())
    }

    async fn apply_state(&self, info: &RunInfo, update: &StateUpdated) -> Result<()> {
        let Some(snapshot) = self.authorization(info).await? else {
            tracing::warn!(run_id = %info.run_id, key = %update.key, "state.updated ignored: no authorization snapshot");
            return Ok(());
        };
        let write = match journal::plan_state_write(
            &snapshot,
            update,
            self.options.max_state_value_bytes,
        ) {
            Ok(w) => w,
            Err(reason) => {
                tracing::warn!(run_id = %info.run_id, scope = %update.scope, key = %update.key, %reason, "state.updated rejected");
                return Ok(());
            }
        };
        match self.deps.stores.state.set(write).await {
            Ok(_) => Ok(()),
            Err(
                e @ (StoreError::PayloadTooLarge(_)
                | StoreError::InvalidArgument(_)
                | StoreError::Conflict(_)),
            ) => {
                tracing::warn!(run_id = %info.run_id, key = %update.key, reason = %e, "state.updated rejected by the store");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn store_artifact(
        &self,
        info: &RunInfo,
        sequence: u64,
        created: &ArtifactCreated,
    ) -> Result<()> {
        let artifact = match journal::plan_artifact(
            info,
            sequence,
            created,
            self.options.max_inline_artifact_bytes,
        ) {
            Ok(a) => a,
            Err(reason) => {
                tracing::warn!(run_id = %info.run_id, sequence, %reason, "artifact.created rejected");
                return Ok(());
            }
        };
        let id = artifact.id.clone().unwrap_or_default();
        match self.deps.stores.artifacts.put(artifact.clone()).await {
            Ok(_) => {}
            Err(StoreError::Conflict(_)) => {
                // Stored by an earlier attempt of this item, or an id another run took.
                let ours = match self.deps.stores.artifacts.metadata(&id).await {
                    Ok(existing) => existing.run_id == Some(info.run_id),
                    Err(StoreError::NotFound(_)) => false,
                    Err(e) => return Err(e.into()),
                };
                if !ours {
                    tracing::warn!(run_id = %info.run_id, artifact_id = %id, "artifact.created rejected: the id is taken");
                    return Ok(());
                }
            }
            Err(e @ (StoreError::InvalidArgument(_) | StoreError::PayloadTooLarge(_))) => {
                tracing::warn!(run_id = %info.run_id, artifact_id = %id, reason = %e, "artifact.created rejected by the store");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        self.deps
            .stores
            .events
            .append(
                journal::artifact_event(info, sequence, &artifact),
                Vec::new(),
            )
            .await?;
        Ok(())
    }

    async fn finish(&self, info: &RunInfo, outcome: RunOutcome, ended: bool) -> Result<()> {
        let status = outcome.status;
        if ended
            || self
                .deps
                .stores
                .runs
                .finish_run(info.run_id, outcome)
                .await?
        {
            Metrics::global().inc(names::RUNS_TOTAL, &[("status", status.as_str())]);
            tracing::info!(run_id = %info.run_id, status = status.as_str(), "run finished");
        }
        // A runner that only streamed leaves no complete message: the transcript gets the
        // assembled deltas instead (the seed host stored nothing, host-behaviour §26.13).
        let messaged = lock(&self.applied)
            .remove(&info.run_id)
            .is_some_and(|applied| applied.messaged());
        if info.conversation_id.is_some() && !messaged {
            let items = self.stored_items(info.run_id).await?;
            if !journal::has_complete_message(&items) {
                if let Some(text) = journal::assembled_deltas(&items) {
                    let refs = journal::artifact_refs_before(&info.run_id, &items, u64::MAX);
                    if let Some(row) =
                        journal::assistant_transcript(info, &Message::assistant(text), refs)
                    {
                        append_once(&self.deps, row).await?;
                    }
                }
            }
        }
        // The conversation is free of this run: the next parked event may start (`enqueue`).
        if let Some(key) = ConversationKey::new(&info.workspace_id, info.conversation_id.as_deref())
        {
            self.conversations.finish_run(&key, info.run_id).await?;
        }
        self.cache().remove(&info.run_id);
        lock(&self.authorizations).remove(&info.run_id);
        Ok(())
    }
}

/// Whether [`ResultSink::apply`] of an item so `plan`ned writes anything its insert did not
/// (`written`) to the ledger: a transcript row, state, an artifact, the run's end, or — for a
/// terminal item whose run needs the transcript check (`checks_transcript`: in a
/// conversation, no complete message applied) — the assembled deltas. The sink delivers the
/// items before such an item first, so they do not wait for those writes; an item that
/// writes nothing more travels with them. A terminal item the insert ended still frees its
/// conversation (one session-store round trip): the items before it wait for that rather
/// than cost a live message of their own (an echo run's deltas, complete message and
/// terminal item, transcribed and ended by the insert, are one live message).
pub(super) fn writes_beyond_insert(
    plan: &ItemPlan,
    written: Written,
    checks_transcript: bool,
) -> bool {
    let effect = match plan.effect {
        Effect::None => false,
        Effect::AssistantMessage(_) => !written.transcribed,
        Effect::State(_) | Effect::Artifact(_) => true,
    };
    effect || plan.outcome.is_some() && (!written.ended || checks_transcript)
}

/// A low-cardinality label for a result type (unknown types share one label).
fn result_type_label(result: &AgentRunResult) -> &'static str {
    result.known_type().map_or("unknown", |t| t.as_str())
}

async fn append_once(deps: &OrchestratorDeps, row: sb_store::NewTranscriptItem) -> Result<()> {
    match deps.stores.transcript.append(row).await {
        // Conflict: the row with this deterministic id already exists (written once).
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use sb_protocol::context::StateScope;
    use serde_json::json;

    use super::*;

    fn plan(effect: Effect, terminal: bool) -> ItemPlan {
        ItemPlan {
            effect,
            outcome: terminal.then(RunOutcome::completed),
        }
    }

    const NOTHING: Written = Written {
        ended: false,
        transcribed: false,
    };
    const BOTH: Written = Written {
        ended: true,
        transcribed: true,
    };

    #[test]
    fn what_the_insert_wrote_is_not_written_again() {
        let message = || Effect::AssistantMessage(Message::assistant("hi"));
        assert!(!writes_beyond_insert(
            &plan(Effect::None, false),
            NOTHING,
            true
        ));
        assert!(writes_beyond_insert(
            &plan(message(), false),
            NOTHING,
            false
        ));
        assert!(!writes_beyond_insert(&plan(message(), false), BOTH, true));
        // A terminal item the insert ended writes nothing more to the ledger (freeing its
        // conversation is not a ledger write)...
        assert!(!writes_beyond_insert(
            &plan(Effect::None, true),
            BOTH,
            false
        ));
        // ...unless its run streamed no complete message into a conversation (the assembled
        // deltas are written then), and without the insert's end it ends the run.
        assert!(writes_beyond_insert(&plan(Effect::None, true), BOTH, true));
        assert!(writes_beyond_insert(
            &plan(Effect::None, true),
            NOTHING,
            false
        ));
    }

    #[test]
    fn state_and_artifacts_are_always_written_after_the_insert() {
        let state = Effect::State(StateUpdated {
            scope: StateScope::Conversation,
            key: "k".into(),
            value: json!(1),
        });
        assert!(writes_beyond_insert(&plan(state, false), BOTH, false));
    }
}
