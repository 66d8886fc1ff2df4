//! Counting and reporting (pure): [`Tally`] counts outcomes and keeps the latency
//! histograms of one worker; [`Report`] is the summary, rendered as a table or JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{Value, json};

use super::check::RunOutcome;
use super::percentiles::{self, Percentiles};
use super::stages::Stages;
use crate::cli::cpu::CpuUsage;

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
        let histogram = percentiles::histogram;
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
    /// Counts `n` stream items of one run.
    pub fn record_items(&mut self, n: u64) {
        self.items += n;
    }

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
    /// Where a sample of the completed runs spent their time on the host, from the ledger
    /// ([`stages`](super::stages)); `None` when it could not be read.
    pub stages: Option<Stages>,
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
            stages: None,
        }
    }

    /// The same report with the CPU `cpu` of its window.
    #[must_use]
    pub fn with_cpu(mut self, cpu: CpuUsage) -> Self {
        self.cpu = cpu;
        self
    }

    /// The same report with the ledger's `stages` of a sample of its runs.
    #[must_use]
    pub fn with_stages(mut self, stages: Option<Stages>) -> Self {
        self.stages = stages;
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
            "stages_ms": self.stages.as_ref().map(Stages::to_json),
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
        if let Some(stages) = &self.stages {
            out.push_str(&format!(
                "host stages     from the ledger, {} runs
",
                stages.runs
            ));
            out.push_str(&row("  route", &stages.route));
            out.push_str(&row("  claim", &stages.claim));
            out.push_str(&row("  execute", &stages.execute));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
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
            12,
            "runs, completed, failed, lost, runs_per_s, first_result_ms, terminal_ms, \
             failed_codes, items_per_s, machine_cpu_ms_per_run, cpu_ms_per_run_by_process, \
             stages_ms: {keys:?}"
        );
        assert_eq!(j["stages_ms"], Value::Null, "no stages read");
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
}
