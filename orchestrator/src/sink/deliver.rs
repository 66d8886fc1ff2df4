//! Step 4 of a batch: live delivery of persisted items to `switchboard.deliveries`.

use sb_common::bus::topology::deliveries_routing_key;
use sb_common::bus::{Outgoing, PublishOptions};
use sb_common::telemetry::{Metrics, names};
use sb_protocol::ids::RunId;
use sb_protocol::messages::{self, StoredItem};

use super::{Item, ResultSink};
use crate::error::{OrchestratorError, Result};

impl ResultSink {
    /// The live delivery of `items`: consecutive persisted items of one run (each with its
    /// result's JSON as stored), as one `switchboard.deliveries/1` message (or a single
    /// `switchboard.delivery/1`).
    pub(super) fn outgoing(&self, items: &[StoredItem<'_>]) -> Outgoing {
        let first = items[0].0;
        let body = messages::encode_delivery(items);
        Outgoing {
            exchange: self.deps.topology.deliveries_exchange(),
            routing_key: deliveries_routing_key(
                first.workspace_id.as_str(),
                first.conversation_id.as_deref(),
                &first.run_id,
            ),
            body: body.into(),
            // Nobody may be streaming this run: live delivery is best effort, the ledger is
            // the source of truth for every reader.
            options: PublishOptions::best_effort(),
        }
    }

    /// Publishes the deliveries of the items at `unsent` (indices into `items`, ascending;
    /// emptied). If the bus fails, the first failed item and every later one of the batch
    /// (those of `outcomes` so far) are set to be requeued, keeping the run order, and
    /// `false` is returned.
    pub(super) async fn deliver(
        &self,
        items: &[Item],
        unsent: &mut Vec<usize>,
        outcomes: &mut [Result<bool>],
    ) -> bool {
        if unsent.is_empty() {
            return true;
        }
        let indices = std::mem::take(unsent);
        // Consecutive items of one run travel as one message.
        let groups = group_by_run(&indices, |i| items[i].message.run_id);
        let batch = groups
            .iter()
            .map(|group| {
                let stored: Vec<StoredItem<'_>> = group
                    .iter()
                    .map(|&i| (&items[i].message, items[i].stored.as_raw()))
                    .collect();
                self.outgoing(&stored)
            })
            .collect();
        match self.deps.bus.publish_batch(batch).await {
            Ok(()) => {
                Metrics::global().add(
                    names::BUS_PUBLISHED_TOTAL,
                    &[("exchange", "deliveries")],
                    groups.len() as u64,
                );
                true
            }
            Err(error) => {
                use sb_protocol::error::{Disposition, HasErrorCode};
                // A message the broker can never take (an invalid routing key, a body over
                // its size limit) is dropped: live delivery is best effort and the items are
                // in the ledger, where every stream reads what it missed. Requeueing it would
                // stall the shard behind it for good and keep its run from ever finishing.
                let (permanent, transient): (Vec<_>, Vec<_>) = error
                    .failed
                    .iter()
                    .partition(|(_, e)| e.code().disposition() != Disposition::Retry);
                for (index, cause) in &permanent {
                    let run_id = items[groups[*index][0]].message.run_id;
                    Metrics::global().inc(
                        names::BUS_PUBLISH_REFUSED_TOTAL,
                        &[("exchange", "deliveries")],
                    );
                    tracing::warn!(%run_id, error = %cause, "live delivery refused by the bus; the items stay in the ledger");
                }
                if transient.is_empty() {
                    return true;
                }
                // Requeue from the first item of the first transiently failed message on,
                // keeping the run order.
                let first_failed = transient.first().map_or(0, |(i, _)| *i);
                let cut = groups[first_failed.min(groups.len() - 1)][0];
                tracing::warn!(%error, "publishing deliveries failed; requeueing");
                for (i, outcome) in outcomes.iter_mut().enumerate().skip(cut) {
                    if i == cut {
                        *outcome = Err(OrchestratorError::Bus(
                            sb_common::bus::BusError::Unavailable(format!(
                                "delivery publish failed: {error}"
                            )),
                        ));
                    } else if outcome.is_ok() {
                        *outcome = Err(OrchestratorError::Deferred);
                    }
                }
                false
            }
        }
    }
}

/// `indices` (ascending) split into runs of consecutive entries with the same `run_of`.
fn group_by_run(indices: &[usize], run_of: impl Fn(usize) -> RunId) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for &i in indices {
        match groups.last_mut() {
            Some(group) if run_of(group[0]) == run_of(i) => group.push(i),
            _ => groups.push(vec![i]),
        }
    }
    groups
}
