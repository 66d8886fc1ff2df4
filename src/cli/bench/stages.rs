//! Where a run's time goes on the host, read back from the ledger after the measurement.
//!
//! The ledger stamps an event, its run's creation, its claim and its end in milliseconds
//! (`created_at_ms` of `GET /v1/events/{id}`; `created_at_ms`, `started_at_ms` and
//! `ended_at_ms` of `GET /v1/runs/{id}`). For a sample of the completed runs, [`read`] turns
//! them into three stages:
//!
//! - **route**: event stored → run created (the ingest's commit, the event's hop to an
//!   orchestrator, routing);
//! - **claim**: run created → claimed by a worker (the start's commit, the job's hop, the
//!   claim);
//! - **execute**: claimed → run ended (the runner, the results' hop, the sink's commit of the
//!   terminal item).
//!
//! The reads happen after the measured window (its CPU figures do not include them), and
//! each stamp is taken by the process that did the step, so in cluster mode a stage spans
//! two clocks: on one machine they agree, across machines the stages are as good as the
//! clocks' agreement.

use futures::StreamExt as _;
use hdrhistogram::Histogram;
use serde_json::{Value, json};

use super::percentiles::{self, Percentiles};
use crate::client::GatewayClient;

/// Most runs a bench reads back.
pub const SAMPLE: u32 = 200;

/// Requests in flight while reading the sample.
const READS_IN_FLIGHT: usize = 8;

/// The ids of a completed run, as the bench saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunIds {
    /// The posted event.
    pub event_id: String,
    /// Its run.
    pub run_id: String,
}

/// One run's ledger stamps, in epoch milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamps {
    /// The event stored.
    pub event_created: i64,
    /// The run created.
    pub run_created: i64,
    /// The run claimed.
    pub started: i64,
    /// The run ended.
    pub ended: i64,
}

impl Stamps {
    /// Route, claim, execute, in milliseconds (negative spans, from clocks that disagree,
    /// count as zero).
    #[must_use]
    pub fn stages(&self) -> [u64; 3] {
        let span = |from: i64, to: i64| u64::try_from(to - from).unwrap_or(0);
        [
            span(self.event_created, self.run_created),
            span(self.run_created, self.started),
            span(self.started, self.ended),
        ]
    }
}

/// The stages' percentiles over the runs read back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stages {
    /// Runs whose stamps were read.
    pub runs: u64,
    /// Event stored → run created.
    pub route: Percentiles,
    /// Run created → claimed.
    pub claim: Percentiles,
    /// Claimed → ended.
    pub execute: Percentiles,
}

impl Stages {
    /// The stages of `stamps`; `None` without any.
    #[must_use]
    pub fn of(stamps: &[Stamps]) -> Option<Self> {
        if stamps.is_empty() {
            return None;
        }
        let mut histograms: [Histogram<u64>; 3] = std::array::from_fn(|_| percentiles::histogram());
        for stamp in stamps {
            for (h, ms) in histograms.iter_mut().zip(stamp.stages()) {
                // Percentiles are kept in microseconds, as the report's latencies are.
                h.saturating_record(ms.saturating_mul(1000));
            }
        }
        let [route, claim, execute] = histograms.map(|h| Percentiles::of(&h));
        Some(Self {
            runs: stamps.len() as u64,
            route,
            claim,
            execute,
        })
    }

    /// The `stages_ms` object of `--json`.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "runs": self.runs,
            "route": self.route.to_json(),
            "claim": self.claim.to_json(),
            "execute": self.execute.to_json(),
        })
    }
}

/// Reads the ledger stamps of `runs` and summarises them; `None` when none could be read
/// (a gateway without the reads, say). A run whose reads fail or lack a stamp is left out.
pub async fn read(client: &GatewayClient, runs: &[RunIds]) -> Option<Stages> {
    let stamps: Vec<Stamps> = futures::stream::iter(runs)
        .map(|ids| stamps_of(client, ids))
        .buffer_unordered(READS_IN_FLIGHT)
        .filter_map(std::future::ready)
        .collect()
        .await;
    Stages::of(&stamps)
}

async fn stamps_of(client: &GatewayClient, ids: &RunIds) -> Option<Stamps> {
    let get = reqwest::Method::GET;
    let event = client
        .json(get.clone(), &format!("/v1/events/{}", ids.event_id), None)
        .await
        .ok()?;
    let run = client
        .json(get, &format!("/v1/runs/{}", ids.run_id), None)
        .await
        .ok()?;
    Some(Stamps {
        event_created: event["created_at_ms"].as_i64()?,
        run_created: run["created_at_ms"].as_i64()?,
        started: run["started_at_ms"].as_i64()?,
        ended: run["ended_at_ms"].as_i64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamps(event: i64, run: i64, started: i64, ended: i64) -> Stamps {
        Stamps {
            event_created: event,
            run_created: run,
            started,
            ended,
        }
    }

    #[test]
    fn stages_are_the_spans_between_the_stamps() {
        assert_eq!(stamps(100, 102, 105, 106).stages(), [2, 3, 1]);
        // A clock behind the previous step's counts as no time, not as a wrap-around.
        assert_eq!(stamps(100, 99, 105, 106).stages(), [0, 6, 1]);
    }

    #[test]
    fn percentiles_over_the_runs() {
        let runs: Vec<Stamps> = (0..100).map(|i| stamps(0, 1 + i % 2, 10, 10 + i)).collect();
        let stages = Stages::of(&runs).unwrap();
        assert_eq!(stages.runs, 100);
        // The histograms keep three significant digits.
        let ms = |p: Option<f64>| p.map(f64::round);
        assert_eq!(ms(stages.route.p50), Some(1.0));
        assert_eq!(ms(stages.route.p99), Some(2.0));
        assert_eq!(ms(stages.claim.p50), Some(8.0));
        assert_eq!(ms(stages.execute.p50), Some(49.0));
        let json = stages.to_json();
        assert_eq!(json["runs"], 100);
        assert_eq!(json["claim"]["p95"].as_f64().map(f64::round), Some(9.0));
        assert!(Stages::of(&[]).is_none());
    }
}
