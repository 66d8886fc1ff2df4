//! One batch of result deliveries: decode, one ledger insert, side effects and live
//! delivery in queue order, then settling (steps 1–5 of the [module docs](super)).

use sb_common::bus::Delivery;
use sb_common::bus::consumer::{pause, settle_outcome};
use sb_common::shutdown::Shutdown;
use sb_common::telemetry::{Metrics, names};
use sb_protocol::messages::{self, ResultMessage};
use std::collections::HashMap;

use sb_protocol::ids::RunId;
use sb_store::{NewRunEvent, NewTranscriptItem};

use super::apply::writes_beyond_insert;
use super::{Item, ResultSink, Written};
use crate::error::{OrchestratorError, Result};
use crate::journal::{self, AppliedItems, Effect};
use crate::lock;

impl ResultSink {
    /// Persists, applies and delivers one batch of result deliveries, then settles them.
    ///
    /// While the ledger or the session store is unreachable, the deliveries that failed on
    /// it (and those deferred behind them) are retried **in place**, with the orchestrator's
    /// retry backoff, until they succeed or shutdown begins: requeueing them would spend the
    /// results queue's delivery limit in seconds and dead-letter a run's items during an
    /// outage longer than that, leaving the run without its terminal item. Holding them keeps
    /// the shard waiting, which is all it could do anyway (every later item needs the same
    /// backends), and keeps each run's items in order.
    pub(crate) async fn process_batch(
        &self,
        deliveries: Vec<Delivery>,
        queue: &str,
        shutdown: &Shutdown,
    ) {
        let mut pending = deliveries;
        let mut attempt = 0u32;
        loop {
            let waiting = self.process_once(pending, queue, shutdown).await;
            if waiting.is_empty() {
                return;
            }
            Metrics::global().add(
                names::BUS_CONSUMED_TOTAL,
                &[("queue", queue), ("disposition", "retry_in_place")],
                waiting.len() as u64,
            );
            tracing::warn!(
                queue,
                deliveries = waiting.len(),
                attempt,
                "ledger or session store unreachable; retrying the results in place"
            );
            if !pause(self.options.retry_delay(attempt), shutdown.as_ref()).await {
                // Shutting down: hand them back to the broker for another consumer.
                for delivery in waiting {
                    if let Err(error) = delivery.nack(true).await {
                        tracing::warn!(%error, queue, "could not requeue a delivery at shutdown");
                    }
                }
                return;
            }
            attempt = attempt.saturating_add(1);
            // Their items may have been stored by the failed attempt: apply them as
            // redelivered (side effects again, all idempotent).
            pending = waiting
                .into_iter()
                .map(|mut delivery| {
                    delivery.redelivered = true;
                    delivery
                })
                .collect();
        }
    }

    /// Stores, applies and delivers the results workers of this process hand over directly,
    /// without the results queue (steps 2–4; see the [module docs](super)): each hand-over is
    /// consecutive items of one run, in sequence order, and whether they were handed over
    /// before (`retried`: then its stored items are applied again, as a redelivery's are;
    /// every side effect is idempotent). The hand-overs given together are one batch, as the
    /// deliveries of one consume are: one ledger insert, their side effects in order, their
    /// live deliveries in one publish.
    ///
    /// One answer per hand-over, in order: `Ok` once every item is in the ledger and applied,
    /// and its live delivery published (best effort, as always); else the error of its first
    /// item that failed (its items from there on were not applied: hand them all over again).
    /// An item that fails transiently defers the later items of the batch, whose hand-overs
    /// get [`OrchestratorError::Deferred`] (retryable).
    ///
    /// Retryable errors ([`Disposition::Retry`]) pass when the ledger, the session store or
    /// the bus is back; others never will (the caller sends such items by the results queue,
    /// whose consumer settles them as it settles any delivery).
    ///
    /// [`Disposition::Retry`]: sb_protocol::error::Disposition::Retry
    pub async fn store(&self, handed: Vec<(Vec<ResultMessage>, bool)>) -> Vec<Result<()>> {
        let mut answers: Vec<Result<()>> = handed.iter().map(|_| Ok(())).collect();
        // An item's `delivery` is the hand-over it came with.
        let mut items = Item::all(handed);
        if items.is_empty() {
            return answers;
        }
        let outcomes = self.persist(&mut items).await;
        for (item, outcome) in items.iter().zip(outcomes) {
            if let (Err(error), Ok(())) = (outcome, &answers[item.delivery]) {
                answers[item.delivery] = Err(error);
            }
        }
        answers
    }

    /// One attempt of [`Self::process_batch`]: settles every delivery except those that
    /// failed on an unreachable backend (and those deferred behind them), which it returns.
    async fn process_once(
        &self,
        deliveries: Vec<Delivery>,
        queue: &str,
        shutdown: &Shutdown,
    ) -> Vec<Delivery> {
        let options = &self.options;
        let mut kept: Vec<Delivery> = Vec::with_capacity(deliveries.len());
        let mut decoded: Vec<(Vec<ResultMessage>, bool)> = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match messages::decode_results(&delivery.body) {
                Ok(messages) => {
                    decoded.push((messages, delivery.redelivered));
                    kept.push(delivery);
                }
                Err(e) => {
                    let outcome: Result<()> = Err(e.into());
                    settle_outcome(delivery, &outcome, queue, &options.retry, shutdown.as_ref())
                        .await;
                }
            }
        }
        let mut items = Item::all(decoded);
        if items.is_empty() {
            return Vec::new();
        }

        let outcomes = self.persist(&mut items).await;

        // 5. Settle each delivery in order, by the outcomes of its items.
        let mut settled: Vec<Option<Result<()>>> = (0..kept.len()).map(|_| None).collect();
        for (item, outcome) in items.iter().zip(outcomes) {
            let slot = &mut settled[item.delivery];
            *slot = Some(match (slot.take(), outcome) {
                // The first failure of its items decides; a deferral only when nothing failed.
                (Some(Err(e)), _) if !matches!(e, OrchestratorError::Deferred) => Err(e),
                (_, Err(e)) => Err(e),
                (Some(Err(e)), Ok(_)) => Err(e),
                (_, Ok(_)) => Ok(()),
            });
        }
        // An unreachable ledger or session store: what failed on it waits in place.
        let outage = settled
            .iter()
            .any(|o| matches!(o, Some(Err(e)) if e.is_backend_outage()));
        let mut waiting = Vec::new();
        for (delivery, outcome) in kept.into_iter().zip(settled) {
            match outcome.unwrap_or(Ok(())) {
                Err(e)
                    if outage
                        && (e.is_backend_outage() || matches!(e, OrchestratorError::Deferred)) =>
                {
                    waiting.push(delivery);
                }
                Err(OrchestratorError::Deferred) => {
                    if let Err(error) = delivery.nack(true).await {
                        tracing::warn!(%error, queue, "could not requeue a deferred delivery");
                    }
                }
                other => {
                    settle_outcome(delivery, &other, queue, &options.retry, shutdown.as_ref())
                        .await;
                }
            }
        }
        waiting
    }

    /// Steps 2–4 for `items` (in queue order): one ledger insert, the side effects in order
    /// and the live deliveries after the ledger write. One outcome per item: `Ok(true)` when
    /// it was applied and delivered, `Ok(false)` for a plain duplicate, else the error of the
    /// item that failed ([`OrchestratorError::Deferred`] for the later ones, not attempted).
    async fn persist(&self, items: &mut [Item]) -> Vec<Result<bool>> {
        // 2. One ledger call for the whole batch, with the runs' ends and the assistant
        // transcript rows it can carry.
        let transcripts = self.transcripts(items).await;
        // Built again for the per-item fallback (the rows share each item's JSON, see
        // `ledger_row`).
        let rows = |items: &[Item]| -> Vec<NewRunEvent> {
            items
                .iter()
                .zip(&transcripts)
                .map(|(i, transcript)| ledger_row(i, transcript.clone()))
                .collect()
        };
        let inserted: Vec<Result<bool>> = match self.inserts.insert(rows(items)).await {
            Some(flags) if flags.len() == items.len() => flags.into_iter().map(Ok).collect(),
            Some(_) | None => {
                // Find out per item (one missing run must not fail the others).
                let mut each = Vec::with_capacity(items.len());
                for row in rows(items) {
                    each.push(
                        self.deps
                            .stores
                            .runs
                            .insert_event(row)
                            .await
                            .map_err(Into::into),
                    );
                }
                each
            }
        };

        // 3. Side effects, in queue order; stop at the first transient failure. Applied items
        // are delivered (4.) in queue order as well, and *before* the side effects of a later
        // item of the batch are written: a delta reaches its readers as soon as it is
        // persisted, not after the transcript and run-status writes of the terminal item that
        // arrived in the same batch.
        let mut outcomes: Vec<Result<bool>> = Vec::with_capacity(items.len());
        let mut unsent: Vec<usize> = Vec::new();
        let mut halted = false;
        for (index, (item, inserted)) in items.iter().zip(inserted).enumerate() {
            if halted {
                outcomes.push(Err(OrchestratorError::Deferred));
                continue;
            }
            // What a new item's insert wrote besides its row.
            let written = Written {
                ended: matches!(inserted, Ok(true)),
                transcribed: matches!(inserted, Ok(true)) && transcripts[index].is_some(),
            };
            // A terminal item that is not new is applied anyway when the ledger holds it as
            // is: its worker stored it itself (see `is_stored_as_is`).
            let inserted = match inserted {
                Ok(false) if !item.redelivered && item.message.result.is_terminal() => {
                    self.is_stored_as_is(&item.message).await
                }
                other => other,
            };
            let outcome = match inserted {
                Err(e) => Err(e),
                Ok(new) if !new && !item.redelivered => Ok(false),
                Ok(_) => {
                    if !unsent.is_empty()
                        && writes_beyond_insert(&item.plan, written, self.checks_transcript(item))
                        && !self.deliver(items, &mut unsent, &mut outcomes).await
                    {
                        halted = true;
                        outcomes.push(Err(OrchestratorError::Deferred));
                        continue;
                    }
                    match self.facts_of(&item.message).await {
                        Ok(info) => self
                            .apply(&info, &item.message, &item.plan, written)
                            .await
                            .map(|()| true),
                        Err(e) => Err(e),
                    }
                }
            };
            if let Err(e) = &outcome {
                use sb_protocol::error::{Disposition, HasErrorCode};
                halted = e.code().disposition() == Disposition::Retry;
            }
            if matches!(outcome, Ok(true)) {
                unsent.push(index);
            }
            outcomes.push(outcome);
        }

        // 4. The remaining deliveries, after the ledger write.
        self.deliver(items, &mut unsent, &mut outcomes).await;
        outcomes
    }

    /// The assistant transcript rows of the batch's items, as far as they are known before
    /// the insert (then the insert writes them, [`NewRunEvent::transcript`], and the side
    /// effects do not): a complete assistant message of a run with a conversation, whose
    /// earlier items this sink applied from the first without a gap or holds in this batch,
    /// so its artifact references are known without reading the ledger. `None` for every
    /// other item, and where the facts cannot be had now: its side effects write it then.
    async fn transcripts(&self, items: &[Item]) -> Vec<Option<NewTranscriptItem>> {
        let mut applied: HashMap<RunId, AppliedItems> = HashMap::new();
        let mut rows = Vec::with_capacity(items.len());
        for item in items {
            let (message, plan) = (&item.message, &item.plan);
            let record = applied.entry(message.run_id).or_insert_with(|| {
                lock(&self.applied)
                    .get(&message.run_id)
                    .cloned()
                    .unwrap_or_default()
            });
            let refs = record.artifact_refs_before(message.sequence);
            record.note(&message.run_id, message.sequence, &plan.effect);
            let row = match (&plan.effect, refs) {
                (Effect::AssistantMessage(reply), Some(refs))
                    if message.conversation_id.is_some() =>
                {
                    match self.facts_of(message).await {
                        Ok(info) => journal::assistant_transcript(&info, reply, refs),
                        Err(_) => None,
                    }
                }
                _ => None,
            };
            rows.push(row);
        }
        rows
    }

    /// Whether applying `item` (a terminal one) includes the transcript check of
    /// [`finish`](ResultSink::finish): its run is in a conversation and this sink applied no
    /// complete assistant message of it (or forgot the run).
    fn checks_transcript(&self, item: &Item) -> bool {
        item.plan.outcome.is_some()
            && item.message.conversation_id.is_some()
            && !lock(&self.applied)
                .get(&item.message.run_id)
                .is_some_and(AppliedItems::messaged)
    }

    /// Whether `message` is exactly the item the ledger holds at its sequence: a terminal
    /// item a worker stored itself before publishing it (a lost run finalized `interrupted`,
    /// [`RunLedger::finalize_run`](sb_store::RunLedger::finalize_run)), whose side effects
    /// and live delivery are still due. A different item at that sequence (a second terminal
    /// item refused by the ledger) is not.
    async fn is_stored_as_is(&self, message: &ResultMessage) -> Result<bool> {
        let sequence = i64::try_from(message.sequence).unwrap_or(i64::MAX);
        let stored = self
            .deps
            .stores
            .runs
            .events_after(message.run_id, sequence - 1, 1)
            .await?;
        Ok(stored.first().is_some_and(|record| {
            record.sequence == sequence && journal::stored_json(&message.result) == record.data
        }))
    }
}

/// The ledger row of `item`: a terminal item ends its run with the insert, and an item
/// carries its assistant `transcript` row when it is known before the insert. Its data is
/// the item's stored JSON, shared (the item keeps it for its live delivery).
fn ledger_row(item: &Item, transcript: Option<NewTranscriptItem>) -> NewRunEvent {
    let data = item.stored.clone();
    let message = &item.message;
    NewRunEvent {
        run_id: message.run_id,
        sequence: i64::try_from(message.sequence).unwrap_or(i64::MAX),
        result_type: message.result.result_type.clone(),
        data,
        ends_run: item.plan.outcome.clone(),
        transcript,
    }
}
