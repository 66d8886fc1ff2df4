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
//! - [`RunCheck`]: the per-run stream checks and outcome (pure).
//! - [`Tally`] and [`Report`]: counting, histograms, the human and JSON output (pure).
//! - [`run`]: the workers and the progress bar.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sb_protocol::result::AgentRunResult;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::api::{FollowError, FollowOptions, GatewayClient, NewEvent, delta_text, message_text};
use super::client::BenchArgs;
use super::cpu::{CpuSample, CpuUsage};

/// Highest latency the histograms record (longer ones are clamped): one hour, in µs.
const MAX_LATENCY_US: u64 = 3_600_000_000;
/// Actor id of the bench's messages.
const BENCH_ACTOR: &str = "bench";

/// How one run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// `run.completed` with an intact stream.
    Completed {
        /// Post → first delivered result.
        first: Duration,
        /// Post → terminal result.
        terminal: Duration,
    },
    /// Ended with a failure code.
    Failed {
        /// See the module docs.
        code: String,
    },
    /// No terminal result: `timeout` or `connection`.
    Lost {
        /// Why.
        reason: &'static str,
    },
}

impl RunOutcome {
    /// The outcome of a follow that ended with `error`.
    #[must_use]
    pub fn from_error(error: &FollowError) -> Self {
        match error {
            FollowError::TimedOut => Self::Lost { reason: "timeout" },
            FollowError::Lost { .. } => Self::Lost {
                reason: "connection",
            },
            other => Self::Failed { code: other.code() },
        }
    }
}

/// Per-run stream checks: feed every yielded result to [`on_result`](Self::on_result); the
/// terminal one returns the outcome.
#[derive(Debug, Default)]
pub struct RunCheck {
    /// Results received (the stream's items).
    items: u64,
    first: Option<Duration>,
    last_sequence: u64,
    gap: bool,
    streamed: String,
    mismatch: bool,
}

impl RunCheck {
    /// Records `result`, received `elapsed` after the post; `Some` once it is terminal.
    pub fn on_result(&mut self, result: &AgentRunResult, elapsed: Duration) -> Option<RunOutcome> {
        self.items += 1;
        self.first.get_or_insert(elapsed);
        if let Some(sequence) = result.sequence {
            if sequence != self.last_sequence + 1 {
                self.gap = true;
            }
            self.last_sequence = sequence;
        }
        match result.result_type.as_str() {
            "message.delta" => self
                .streamed
                .push_str(&delta_text(result).unwrap_or_default()),
            "message.completed" => self.check_message(result),
            "run.completed" => {
                self.check_message(result);
                let code = if self.gap {
                    "client.sequence_gap"
                } else if self.mismatch {
                    "client.reply_mismatch"
                } else {
                    return Some(RunOutcome::Completed {
                        first: self.first.unwrap_or(elapsed),
                        terminal: elapsed,
                    });
                };
                return Some(RunOutcome::Failed { code: code.into() });
            }
            "run.failed" => {
                let code = result
                    .data
                    .get("code")
                    .and_then(Value::as_str)
                    .filter(|c| !c.is_empty())
                    .unwrap_or("run.failed");
                return Some(RunOutcome::Failed { code: code.into() });
            }
            _ => {}
        }
        None
    }

    /// A completed message must equal what was streamed of it (if anything was).
    fn check_message(&mut self, result: &AgentRunResult) {
        if let Some(text) = message_text(result) {
            if !self.streamed.is_empty() && self.streamed != text {
                self.mismatch = true;
            }
            self.streamed.clear();
        }
    }
}

/// Outcome counts and latency histograms (µs). Workers keep one each and merge at the end.
#[derive(Debug, Clone)]
pub struct Tally {
    completed: u64,
    /// Stream items received, over all runs.
    items: u64,
    /// Connections re-opened after a drop or a retryable error, over all runs.
    reconnects: u64,
    failed: BTreeMap<String, u64>,
    lost: BTreeMap<&'static str, u64>,
    first: Histogram<u64>,
    terminal: Histogram<u64>,
}

impl Default for Tally {
    fn default() -> Self {
        let histogram =
            || Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds");
        Self {
            completed: 0,
            items: 0,
            reconnects: 0,
            failed: BTreeMap::new(),
            lost: BTreeMap::new(),
            first: histogram(),
            terminal: histogram(),
        }
    }
}

impl Tally {
    /// Counts one run.
    pub fn record(&mut self, outcome: &RunOutcome) {
        match outcome {
            RunOutcome::Completed { first, terminal } => {
                self.completed += 1;
                self.first.saturating_record(micros(*first));
                self.terminal.saturating_record(micros(*terminal));
            }
            RunOutcome::Failed { code } => *self.failed.entry(code.clone()).or_default() += 1,
            RunOutcome::Lost { reason } => *self.lost.entry(reason).or_default() += 1,
        }
    }

    /// Counts connections re-opened while following a run.
    pub fn record_reconnects(&mut self, n: u32) {
        self.reconnects += u64::from(n);
    }

    /// Adds `other`'s counts and samples.
    pub fn merge(&mut self, other: &Tally) {
        self.completed += other.completed;
        self.items += other.items;
        self.reconnects += other.reconnects;
        for (code, n) in &other.failed {
            *self.failed.entry(code.clone()).or_default() += n;
        }
        for (reason, n) in &other.lost {
            *self.lost.entry(reason).or_default() += n;
        }
        // Same bounds on both sides, so adding cannot fail.
        self.first.add(&other.first).expect("same histogram bounds");
        self.terminal
            .add(&other.terminal)
            .expect("same histogram bounds");
    }

    /// Runs counted.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.completed + self.failed.values().sum::<u64>() + self.lost.values().sum::<u64>()
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// p50/p95/p99 in milliseconds (`None` without samples).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        let at = |q: f64| (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0);
        Self {
            p50: at(0.50),
            p95: at(0.95),
            p99: at(0.99),
        }
    }

    fn to_json(self) -> Value {
        json!({"p50": self.p50, "p95": self.p95, "p99": self.p99})
    }
}

/// The summary of a bench.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Runs started (= accounted for).
    pub runs: u64,
    /// Completed runs.
    pub completed: u64,
    /// Failed runs.
    pub failed: u64,
    /// Lost runs.
    pub lost: u64,
    /// Completed runs per second of wall time.
    pub runs_per_s: f64,
    /// Post → first result of completed runs.
    pub first_result_ms: Percentiles,
    /// Post → terminal result of completed runs.
    pub terminal_ms: Percentiles,
    /// Failed runs by code.
    pub failed_codes: BTreeMap<String, u64>,
    /// Lost runs by reason.
    pub lost_reasons: BTreeMap<&'static str, u64>,
    /// Connections re-opened (resumed streams, retried requests).
    pub reconnects: u64,
    /// First post to last outcome.
    pub wall: Duration,
    /// Stream items received per second of wall time (every run's results).
    pub items_per_s: f64,
    /// CPU the window cost: the machine's and the watched processes'.
    pub cpu: CpuUsage,
}

impl Report {
    /// Summarises `tally` over `wall`.
    #[must_use]
    pub fn new(tally: &Tally, wall: Duration) -> Self {
        let secs = wall.as_secs_f64();
        Self {
            runs: tally.total(),
            completed: tally.completed,
            failed: tally.failed.values().sum(),
            lost: tally.lost.values().sum(),
            runs_per_s: if secs > 0.0 {
                tally.completed as f64 / secs
            } else {
                0.0
            },
            first_result_ms: Percentiles::of(&tally.first),
            terminal_ms: Percentiles::of(&tally.terminal),
            failed_codes: tally.failed.clone(),
            lost_reasons: tally.lost.clone(),
            reconnects: tally.reconnects,
            wall,
            items_per_s: if secs > 0.0 {
                tally.items as f64 / secs
            } else {
                0.0
            },
            cpu: CpuUsage::default(),
        }
    }

    /// The same report with the CPU `cpu` of its window.
    #[must_use]
    pub fn with_cpu(mut self, cpu: CpuUsage) -> Self {
        self.cpu = cpu;
        self
    }

    /// CPU milliseconds per completed run: the machine's, then the watched processes' by
    /// their label (`switchboard gateway`, `postgres`, …).
    #[must_use]
    pub fn cpu_ms_per_run(&self) -> (Option<f64>, BTreeMap<String, f64>) {
        let per_run = |secs: f64| {
            (self.completed > 0)
                .then(|| (secs * 1000.0 / self.completed as f64 * 1000.0).round() / 1000.0)
        };
        (
            self.cpu.machine.and_then(per_run),
            self.cpu
                .by_label
                .iter()
                .filter_map(|(label, secs)| per_run(*secs).map(|ms| (label.clone(), ms)))
                .collect(),
        )
    }

    /// Whether every run completed.
    #[must_use]
    pub fn all_completed(&self) -> bool {
        self.completed == self.runs
    }

    /// The `--json` object.
    #[must_use]
    pub fn to_json(&self) -> Value {
        json!({
            "runs": self.runs,
            "completed": self.completed,
            "failed": self.failed,
            "lost": self.lost,
            "runs_per_s": (self.runs_per_s * 1000.0).round() / 1000.0,
            "first_result_ms": self.first_result_ms.to_json(),
            "terminal_ms": self.terminal_ms.to_json(),
            "failed_codes": self.failed_codes,
            "items_per_s": (self.items_per_s * 10.0).round() / 10.0,
            "machine_cpu_ms_per_run": self.cpu_ms_per_run().0,
            "cpu_ms_per_run_by_process": self.cpu_ms_per_run().1,
        })
    }

    /// The human-readable summary.
    #[must_use]
    pub fn render(&self) -> String {
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3} ms"));
        let row = |name: &str, p: &Percentiles| {
            format!(
                "{name:<16}{:>14}{:>14}{:>14}\n",
                ms(p.p50),
                ms(p.p95),
                ms(p.p99)
            )
        };
        let counts = |m: Vec<(String, u64)>| {
            m.into_iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut out = format!(
            "runs            {} in {:.2} s: {} completed, {} failed, {} lost\n\
             throughput      {:.1} runs/s\n\
             {:<16}{:>14}{:>14}{:>14}\n",
            self.runs,
            self.wall.as_secs_f64(),
            self.completed,
            self.failed,
            self.lost,
            self.runs_per_s,
            "latency",
            "p50",
            "p95",
            "p99",
        );
        out.push_str(&row("first result", &self.first_result_ms));
        out.push_str(&row("terminal", &self.terminal_ms));
        out.push_str(&format!(
            "items           {:.1} streamed items/s\n",
            self.items_per_s
        ));
        let (machine, by_pid) = self.cpu_ms_per_run();
        if let Some(ms) = machine {
            out.push_str(&format!(
                "machine cpu     {ms:.3} ms per run (all processes, /proc/stat)\n"
            ));
        }
        for (label, ms) in by_pid {
            out.push_str(&format!("  {label:<22}{ms:.3} ms per run\n"));
        }
        if !self.failed_codes.is_empty() {
            let failed = self
                .failed_codes
                .iter()
                .map(|(k, n)| (k.clone(), *n))
                .collect();
            out.push_str(&format!("failed          {}\n", counts(failed)));
        }
        if !self.lost_reasons.is_empty() {
            let lost = self
                .lost_reasons
                .iter()
                .map(|(k, n)| ((*k).to_owned(), *n))
                .collect();
            out.push_str(&format!("lost            {}\n", counts(lost)));
        }
        if self.reconnects > 0 {
            out.push_str(&format!("reconnects      {}\n", self.reconnects));
        }
        out
    }
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
struct Plan {
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
    progress: ProgressBar,
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
    let plan = Arc::new(Plan {
        client,
        runs: args.runs,
        conversations: args.conversations,
        run_timeout: Duration::from_secs(args.run_timeout),
        text: bench_text(args.text_words),
        tag: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
        next: AtomicU32::new(0),
        failed: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        progress,
    });
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
    let report = Report::new(&tally, wall).with_cpu(cpu_before.until(&CpuSample::take(&args.pids)));
    plan.progress.finish_and_clear();
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
        let (outcome, reconnects, items) = one_run(&plan, i).await;
        tally.record_reconnects(reconnects);
        tally.items += items;
        match &outcome {
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

/// Runs number `i`; also returns how many connections had to be re-opened and how many
/// items its stream delivered.
async fn one_run(plan: &Plan, i: u32) -> (RunOutcome, u32, u64) {
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
    (outcome, follower.reconnects(), check.items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::api::test_gateway::{Script, TEST_KEY, TestGateway};
    use crate::cli::{Cli, Command};
    use clap::Parser as _;

    fn result(t: &str, sequence: u64, data: Value) -> AgentRunResult {
        serde_json::from_value(json!({"type": t, "data": data, "sequence": sequence})).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn feed(items: &[AgentRunResult]) -> Option<RunOutcome> {
        let mut check = RunCheck::default();
        items
            .iter()
            .enumerate()
            .find_map(|(i, r)| check.on_result(r, ms(10 * (i as u64 + 1))))
    }

    fn delta(seq: u64, s: &str) -> AgentRunResult {
        result(
            "message.delta",
            seq,
            json!({"chunk": {"role": "assistant", "content": s}}),
        )
    }

    fn completed(seq: u64, s: &str) -> AgentRunResult {
        result(
            "message.completed",
            seq,
            json!({"message": {"role": "assistant", "content": s}}),
        )
    }

    fn done(seq: u64) -> AgentRunResult {
        result("run.completed", seq, json!({"finish_reason": "stop"}))
    }

    #[test]
    fn a_clean_run_completes_with_its_latencies() {
        let outcome = feed(&[delta(1, "a "), delta(2, "b"), completed(3, "a b"), done(4)]);
        assert_eq!(
            outcome,
            Some(RunOutcome::Completed {
                first: ms(10),
                terminal: ms(40)
            })
        );
        assert_eq!(
            feed(&[done(1)]),
            Some(RunOutcome::Completed {
                first: ms(10),
                terminal: ms(10)
            })
        );
        assert_eq!(feed(&[delta(1, "a")]), None, "no terminal yet");
    }

    #[test]
    fn gaps_and_mismatches_fail_the_run() {
        let failed = |code: &str| Some(RunOutcome::Failed { code: code.into() });
        assert_eq!(
            feed(&[delta(1, "a "), completed(3, "a b"), done(4)]),
            failed("client.sequence_gap")
        );
        assert_eq!(
            feed(&[delta(1, "a "), delta(2, "c"), completed(3, "a b"), done(4)]),
            failed("client.reply_mismatch")
        );
        assert_eq!(
            feed(&[
                delta(1, "x"),
                result(
                    "run.failed",
                    2,
                    json!({"code": "runner.crashed", "error": "e", "retryable": false})
                )
            ]),
            failed("runner.crashed")
        );
        assert_eq!(
            feed(&[result("run.failed", 1, json!({}))]),
            failed("run.failed")
        );
    }

    #[test]
    fn follow_errors_map_to_failed_or_lost() {
        assert_eq!(
            RunOutcome::from_error(&FollowError::TimedOut),
            RunOutcome::Lost { reason: "timeout" }
        );
        assert_eq!(
            RunOutcome::from_error(&FollowError::Lost {
                attempts: 3,
                last_error: "refused".into()
            }),
            RunOutcome::Lost {
                reason: "connection"
            }
        );
        let unrouted = FollowError::NotRun {
            event_id: "e".into(),
            status: "unrouted".into(),
            reason: None,
            run_id: None,
        };
        assert_eq!(
            RunOutcome::from_error(&unrouted),
            RunOutcome::Failed {
                code: "event.unrouted".into()
            }
        );
    }

    #[test]
    fn tally_counts_merges_and_reports_percentiles() {
        let mut a = Tally::default();
        let mut b = Tally::default();
        for i in 1..=100u64 {
            let t = if i % 2 == 0 { &mut a } else { &mut b };
            t.record(&RunOutcome::Completed {
                first: ms(i),
                terminal: ms(10 * i),
            });
        }
        a.record(&RunOutcome::Failed {
            code: "runner.error".into(),
        });
        b.record(&RunOutcome::Failed {
            code: "runner.error".into(),
        });
        b.record(&RunOutcome::Lost { reason: "timeout" });
        b.record_reconnects(2);
        a.merge(&b);
        assert_eq!(a.total(), 103);

        let report = Report::new(&a, Duration::from_secs(4));
        assert_eq!(
            (report.runs, report.completed, report.failed, report.lost),
            (103, 100, 2, 1)
        );
        assert_eq!(report.runs_per_s, 25.0);
        // hdrhistogram with 3 significant digits: values are exact to 0.1 %.
        let close = |v: Option<f64>, want: f64| (v.unwrap() - want).abs() <= want * 0.001;
        assert!(
            close(report.first_result_ms.p50, 50.0),
            "{:?}",
            report.first_result_ms
        );
        assert!(
            close(report.first_result_ms.p95, 95.0),
            "{:?}",
            report.first_result_ms
        );
        assert!(
            close(report.first_result_ms.p99, 99.0),
            "{:?}",
            report.first_result_ms
        );
        assert!(
            close(report.terminal_ms.p99, 990.0),
            "{:?}",
            report.terminal_ms
        );
        assert!(!report.all_completed());

        let j = report.to_json();
        assert_eq!(j["runs"], 103);
        assert_eq!(j["failed_codes"], json!({"runner.error": 2}));
        assert_eq!(j["runs_per_s"], 25.0);
        let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys.len(),
            11,
            "runs, completed, failed, lost, runs_per_s, first_result_ms, terminal_ms, \
             failed_codes, items_per_s, machine_cpu_ms_per_run, cpu_ms_per_run_by_process: {keys:?}"
        );
        // CPU per completed run, from the window's usage.
        let cpu = CpuUsage {
            machine: Some(0.5),
            pids: BTreeMap::from([(7, 0.25)]),
            by_label: BTreeMap::from([("switchboard gateway".to_owned(), 0.25)]),
        };
        let with_cpu = report.clone().with_cpu(cpu);
        let per_run = with_cpu.completed as f64;
        let (machine, by_pid) = with_cpu.cpu_ms_per_run();
        assert!(
            (machine.unwrap() - 500.0 / per_run).abs() < 0.001,
            "{machine:?}"
        );
        assert!(
            (by_pid["switchboard gateway"] - 250.0 / per_run).abs() < 0.001,
            "{by_pid:?}"
        );
        assert!(with_cpu.render().contains("ms per run"));

        let text = report.render();
        assert!(
            text.contains("103 in 4.00 s: 100 completed, 2 failed, 1 lost"),
            "{text}"
        );
        assert!(text.contains("25.0 runs/s"), "{text}");
        assert!(text.contains("failed          runner.error 2"), "{text}");
        assert!(text.contains("lost            timeout 1"), "{text}");
        assert!(text.contains("reconnects      2"), "{text}");
    }

    #[test]
    fn empty_report_has_null_percentiles() {
        let report = Report::new(&Tally::default(), Duration::ZERO);
        assert_eq!(report.runs_per_s, 0.0);
        assert_eq!(
            report.to_json()["first_result_ms"],
            json!({"p50": null, "p95": null, "p99": null})
        );
        assert!(report.render().contains("first result                 -"));
    }

    #[test]
    fn microsecond_precision_and_clamping() {
        let mut t = Tally::default();
        t.record(&RunOutcome::Completed {
            first: Duration::from_micros(1234),
            terminal: Duration::from_secs(10 * 3600),
        });
        let r = Report::new(&t, Duration::from_secs(1));
        assert_eq!(r.first_result_ms.p50, Some(1.234));
        assert!(r.terminal_ms.p50.unwrap() >= 3_600_000.0 * 0.999);
    }

    #[test]
    fn text_has_the_requested_words() {
        assert_eq!(bench_text(3), "alpha bravo charlie");
        assert_eq!(bench_text(10).split(' ').count(), 10);
        assert_eq!(bench_text(0), "");
    }

    fn bench_args(url: &str, extra: &[&str]) -> BenchArgs {
        let mut argv = vec!["switchboard", "bench", "--url", url, "--json"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Bench(a) => a,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn bench_runs_every_run_over_the_conversations() {
        let gw = TestGateway::start(Script {
            drop_after: vec![1, 0, 2],
            ..Script::default()
        })
        .await;
        let args = bench_args(
            &gw.url(),
            &[
                "--runs",
                "20",
                "--concurrency",
                "4",
                "--conversations",
                "3",
                "--text-words",
                "5",
            ],
        );
        let code = run(args, Some(TEST_KEY.into())).await.unwrap();
        assert_eq!(code, ExitCode::SUCCESS);
        let stats = gw.stats();
        assert_eq!(stats.events_created, 20);
        let mut conversations = stats.conversations.clone();
        conversations.sort();
        conversations.dedup();
        assert_eq!(conversations.len(), 3, "{conversations:?}");
        assert!(
            stats
                .texts
                .iter()
                .all(|t| t == "alpha bravo charlie delta echo")
        );
        let mut keys = stats.idempotency_keys.clone();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 20, "one key per run (re-posts reuse theirs)");
    }

    #[tokio::test]
    async fn bench_accounts_for_failed_and_lost_runs() {
        // Every run fails with a code.
        let gw = TestGateway::start(Script {
            fail_with: Some("runner.crashed"),
            ..Script::default()
        })
        .await;
        let args = bench_args(&gw.url(), &["--runs", "5", "--concurrency", "2"]);
        assert_eq!(
            run(args, Some(TEST_KEY.into())).await.unwrap(),
            ExitCode::FAILURE
        );

        // Every run stalls: lost by timeout, all of them.
        let gw = TestGateway::start(Script {
            stall_after: Some(1),
            ..Script::default()
        })
        .await;
        let mut tally = Tally::default();
        let plan = test_plan(&gw.url(), 3, Duration::from_millis(300));
        for i in 0..3 {
            tally.record(&one_run(&plan, i).await.0);
        }
        let report = Report::new(&tally, Duration::from_secs(1));
        assert_eq!((report.runs, report.lost), (3, 3));
        assert_eq!(report.lost_reasons.get("timeout"), Some(&3));

        // A missing item is caught.
        let gw = TestGateway::start(Script {
            skip_sequence: Some(2),
            ..Script::default()
        })
        .await;
        let plan = test_plan(&gw.url(), 1, Duration::from_secs(10));
        assert_eq!(
            one_run(&plan, 0).await.0,
            RunOutcome::Failed {
                code: "client.sequence_gap".into()
            }
        );
    }

    fn test_plan(url: &str, runs: u32, run_timeout: Duration) -> Plan {
        Plan {
            client: GatewayClient::new(url, Some(TEST_KEY)).unwrap(),
            runs,
            conversations: 1,
            run_timeout,
            text: bench_text(3),
            tag: "t".into(),
            next: AtomicU32::new(0),
            failed: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            progress: ProgressBar::hidden(),
        }
    }
}
