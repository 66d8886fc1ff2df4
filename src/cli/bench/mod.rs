//! `switchboard bench`: drives runs of the echo runner through a running gateway and
//! reports throughput and latency.
//!
//! `--concurrency` workers take run numbers from a shared counter until `--runs` are
//! started. Run *i* posts a `--text-words`-word message into conversation `i mod
//! --conversations` and follows its stream like `send` does (resuming dropped connections),
//! timing from just before the post (t0) to the first delivered result and to the terminal
//! one.
//!
//! Every run ends in exactly one bucket:
//! - **completed**: `run.completed`, with the stream intact: sequences contiguous from 1
//!   and, when the reply was streamed, the deltas adding up to the completed message;
//! - **failed**, by code: the `run.failed` code, the gateway's error code (`unauthorized`,
//!   `unavailable` after retries, …), `event.unrouted`/`event.rejected`/`event.claimed`,
//!   `protocol_error`, or the integrity checks `client.sequence_gap` /
//!   `client.reply_mismatch`;
//! - **lost**: no terminal result within `--run-timeout` (`timeout`), or the connection
//!   kept failing after the retries (`connection`).
//!
//! Latency percentiles are over completed runs; throughput is completed runs per second of
//! wall time (first post to last outcome). The exit status is non-zero unless every run
//! completed.
//!
//! # Layout
//! - this file: the flags ([`BenchArgs`]), [`run`] (the workers and the progress bar) and
//!   the [`Plan`] they share.
//! - [`check`]: [`RunCheck`], the per-run stream checks and outcome (pure).
//! - [`report`]: [`Tally`] and [`Report`]: counting, histograms, the human and JSON output
//!   (pure).
//! - [`percentiles`]: [`Percentiles`] of the latency histograms, shared by the two below.
//! - [`stages`]: where a sample of the completed runs spent their time on the host, read
//!   back from the ledger after the measured window.

pub mod check;
pub mod percentiles;
pub mod report;
pub mod stages;

use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::Instant;

pub use check::{RunCheck, RunOutcome};
pub use percentiles::Percentiles;
pub use report::{Report, Tally};
pub use stages::{RunIds, Stages};

use crate::cli::config::{ConfigArgs, Overrides};
use crate::cli::cpu::CpuSample;
use crate::cli::gateway::GatewayClientArgs;
use crate::client::{FollowOptions, GatewayClient, NewEvent};

/// Actor id of the bench's messages.
const BENCH_ACTOR: &str = "bench";

/// `switchboard bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Total runs to start.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub runs: u32,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub concurrency: u32,
    /// Distinct conversations the runs are spread over.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub conversations: u32,
    /// Words per message (the echo runner streams one delta per word).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub text_words: u32,
    /// A run without a terminal result this many seconds after its post counts as lost.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub run_timeout: u64,
    /// Print the summary as JSON on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Processes whose CPU time over the measured window is reported one by one (the
    /// gateway, orchestrators, workers, runners, broker, databases), comma-separated.
    #[arg(long, value_name = "PID,...", value_delimiter = ',')]
    pub pids: Vec<u32>,
    #[command(flatten)]
    pub gateway: GatewayClientArgs,
}

/// Drives load and prints throughput and latency percentiles.
pub async fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let _config = args.config.load_and_init_logging(Overrides::default())?;
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.conversations > 0, "--conversations must be at least 1");
    let api_key = args.gateway.resolved_api_key()?;
    run(args, api_key).await
}

/// The message of every run: `words` words (the echo runner streams one delta per word).
#[must_use]
pub fn bench_text(words: u32) -> String {
    const VOCABULARY: [&str; 8] = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    ];
    (0..words as usize)
        .map(|i| VOCABULARY[i % VOCABULARY.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// What every worker needs.
pub struct Plan {
    client: GatewayClient,
    runs: u32,
    conversations: u32,
    run_timeout: Duration,
    text: String,
    /// Unique per bench invocation: keeps idempotency keys and conversations of two
    /// benches apart.
    tag: String,
    next: AtomicU32,
    failed: AtomicU64,
    lost: AtomicU64,
    /// The ids of up to [`stages::SAMPLE`] completed runs spread over the bench (every
    /// [`Plan::sample_stride`]-th run), read back after the window.
    sample: Mutex<Vec<RunIds>>,
    progress: ProgressBar,
}

impl Plan {
    /// A plan of `runs` runs of `text` over `conversations` conversations; `tag` keeps its
    /// idempotency keys and conversations apart from other benches'. No progress bar.
    #[must_use]
    pub fn new(
        client: GatewayClient,
        runs: u32,
        conversations: u32,
        run_timeout: Duration,
        text: String,
        tag: String,
    ) -> Self {
        Self {
            client,
            runs,
            conversations,
            run_timeout,
            text,
            tag,
            next: AtomicU32::new(0),
            failed: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            sample: Mutex::new(Vec::new()),
            progress: ProgressBar::hidden(),
        }
    }

    /// Every how many runs one is read back for the host stages: the sample spreads over
    /// the whole bench (its ramp-up and its steady state) and holds at most
    /// [`stages::SAMPLE`] runs.
    fn sample_stride(&self) -> u32 {
        self.runs.div_ceil(stages::SAMPLE).max(1)
    }

    /// The same plan, showing its progress on `progress`.
    #[must_use]
    pub fn with_progress(mut self, progress: ProgressBar) -> Self {
        self.progress = progress;
        self
    }
}

/// Runs `bench` with the resolved API key.
pub async fn run(args: BenchArgs, api_key: Option<String>) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.text_words > 0, "--text-words must be at least 1");
    anyhow::ensure!(
        args.run_timeout > 0,
        "--run-timeout must be at least 1 second"
    );
    let client = GatewayClient::new(&args.gateway.url, api_key.as_deref())?;
    let progress = if args.json {
        ProgressBar::hidden()
    } else {
        let bar =
            ProgressBar::with_draw_target(Some(u64::from(args.runs)), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{wide_bar}] {pos}/{len} {per_sec} {msg}",
            )
            .expect("valid progress template")
            .progress_chars("=> "),
        );
        bar
    };
    let plan = Arc::new(
        Plan::new(
            client,
            args.runs,
            args.conversations,
            Duration::from_secs(args.run_timeout),
            bench_text(args.text_words),
            uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
        )
        .with_progress(progress),
    );
    let cpu_before = CpuSample::take(&args.pids);
    let started = Instant::now();
    let workers: Vec<_> = (0..args.concurrency.min(args.runs))
        .map(|_| tokio::spawn(worker(plan.clone())))
        .collect();
    let mut tally = Tally::default();
    for w in workers {
        tally.merge(&w.await?);
    }
    let wall = started.elapsed();
    let cpu = cpu_before.until(&CpuSample::take(&args.pids));
    plan.progress.finish_and_clear();
    let sample = std::mem::take(&mut *plan.sample.lock().expect("sample lock"));
    let report = Report::new(&tally, wall)
        .with_cpu(cpu)
        .with_stages(stages::read(&plan.client, &sample).await);
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.render());
    }
    Ok(if report.all_completed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn worker(plan: Arc<Plan>) -> Tally {
    let mut tally = Tally::default();
    loop {
        let i = plan.next.fetch_add(1, Ordering::Relaxed);
        if i >= plan.runs {
            return tally;
        }
        let (outcome, reconnects, items, ids) = one_run(&plan, i).await;
        tally.record_reconnects(reconnects);
        tally.record_items(items);
        match &outcome {
            RunOutcome::Completed { .. } if i % plan.sample_stride() == 0 => {
                if let Some(ids) = ids {
                    plan.sample.lock().expect("sample lock").push(ids);
                }
            }
            RunOutcome::Completed { .. } => {}
            RunOutcome::Failed { code } => {
                tracing::debug!(run = i, %code, "bench run failed");
                plan.failed.fetch_add(1, Ordering::Relaxed);
            }
            RunOutcome::Lost { reason } => {
                tracing::debug!(run = i, %reason, "bench run lost");
                plan.lost.fetch_add(1, Ordering::Relaxed);
            }
        }
        tally.record(&outcome);
        let (failed, lost) = (
            plan.failed.load(Ordering::Relaxed),
            plan.lost.load(Ordering::Relaxed),
        );
        if failed + lost > 0 {
            plan.progress
                .set_message(format!("failed {failed}, lost {lost}"));
        }
        plan.progress.inc(1);
    }
}

/// Runs number `i`; also returns how many connections had to be re-opened, how many items
/// its stream delivered and, once it has a run, the ids of its event and run.
pub async fn one_run(plan: &Plan, i: u32) -> (RunOutcome, u32, u64, Option<RunIds>) {
    let event = NewEvent::message(
        &format!("bench-{}-{}", plan.tag, i % plan.conversations),
        BENCH_ACTOR,
        &plan.text,
    );
    let t0 = Instant::now();
    let options = FollowOptions {
        deadline: Some(t0 + plan.run_timeout),
        ..FollowOptions::default()
    };
    let mut follower = plan
        .client
        .follow(event, format!("bench-{}-{i}", plan.tag), options);
    let mut check = RunCheck::default();
    let outcome = loop {
        match follower.next().await {
            Ok(Some(result)) => {
                if let Some(outcome) = check.on_result(&result, t0.elapsed()) {
                    break outcome;
                }
            }
            // The follower ends only after a terminal result, which broke out above.
            Ok(None) => {
                break RunOutcome::Lost {
                    reason: "connection",
                };
            }
            Err(error) => break RunOutcome::from_error(&error),
        }
    };
    let ids = follower
        .event_id()
        .zip(follower.run_id())
        .map(|(event_id, run_id)| RunIds {
            event_id: event_id.to_owned(),
            run_id: run_id.to_owned(),
        });
    (outcome, follower.reconnects(), check.items, ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser as _;

    #[test]
    fn the_stages_sample_spreads_over_the_bench() {
        let plan = |runs| {
            let client = GatewayClient::new("http://127.0.0.1:9", None).unwrap();
            Plan::new(
                client,
                runs,
                1,
                Duration::from_secs(1),
                String::new(),
                "t".into(),
            )
        };
        for (runs, stride, sampled) in [(3000, 15, 200), (300, 2, 150), (10, 1, 10), (1, 1, 1)] {
            let plan = plan(runs);
            assert_eq!(plan.sample_stride(), stride, "{runs} runs");
            let n = (0..runs).filter(|i| i % plan.sample_stride() == 0).count();
            assert_eq!(n, sampled, "{runs} runs");
            assert!(n <= stages::SAMPLE as usize);
        }
    }

    #[test]
    fn text_has_the_requested_words() {
        assert_eq!(bench_text(3), "alpha bravo charlie");
        assert_eq!(bench_text(10).split(' ').count(), 10);
        assert_eq!(bench_text(0), "");
    }

    #[test]
    fn bench_defaults() {
        let cli = Cli::try_parse_from(["switchboard", "bench", "--runs", "10", "--json"]).unwrap();
        let Command::Bench(b) = cli.command else {
            panic!()
        };
        assert_eq!(
            (b.runs, b.concurrency, b.conversations, b.text_words),
            (10, 32, 100, 8)
        );
        assert!(b.json);
    }
}
