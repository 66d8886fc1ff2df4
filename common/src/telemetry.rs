//! Logging initialisation, metric names and a small Prometheus registry.
//!
//! - [`init`] installs the global `tracing` subscriber (text or JSON, `EnvFilter`).
//! - [`names`] holds every metric name, so a name is spelled once and grep finds its users.
//!   Names follow `sb_<noun>_<unit>[_total]`; labels are low-cardinality only (a status, an
//!   action, a queue kind). Never put a run id, event id or conversation id in a label.
//! - [`Registry`] keeps counters, gauges and histograms keyed by name + labels and renders
//!   them in the Prometheus text format for `GET /metrics`. It is a mutex around a map: metric
//!   updates happen a few times per run, far from the hot paths where a lock would matter.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};

use tracing_subscriber::EnvFilter;

use crate::config::TelemetryConfig;

/// Why logging could not be initialised.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The log filter does not parse.
    #[error("invalid log filter `{filter}`: {reason}")]
    InvalidFilter {
        /// The rejected filter text.
        filter: String,
        /// The parser's explanation.
        reason: String,
    },
    /// A global subscriber is already installed (e.g. `init` called twice).
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
}

/// Parses a filter in `EnvFilter` syntax (`info`, `info,sb_worker=debug`).
pub fn parse_filter(filter: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(filter).map_err(|e| TelemetryError::InvalidFilter {
        filter: filter.to_owned(),
        reason: e.to_string(),
    })
}

/// Installs the global `tracing` subscriber: `config.log_level` (or `RUST_LOG` when set and
/// non-empty, the usual Rust convention), text or JSON lines on stderr.
pub fn init(config: &TelemetryConfig) -> Result<(), TelemetryError> {
    let filter_text = std::env::var("RUST_LOG")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| config.log_level.clone());
    let filter = parse_filter(&filter_text)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if config.json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init()
    } else {
        builder.try_init()
    };
    result.map_err(|_| TelemetryError::AlreadyInitialized)
}

/// Every metric name, with its kind and help text in [`DEFINITIONS`].
pub mod names {
    /// Counter `{outcome = accepted|duplicate|rejected|scheduled}`: events received by
    /// `POST /v1/events`, and (`scheduled`) events ingested by firing schedules.
    pub const EVENTS_INGESTED_TOTAL: &str = "sb_events_ingested_total";
    /// Counter `{outcome = dispatched|steered|unrouted|rejected|enqueued}`: events routed.
    pub const EVENTS_ROUTED_TOTAL: &str = "sb_events_routed_total";
    /// Counter `{status}`: runs that reached a terminal status.
    pub const RUNS_TOTAL: &str = "sb_runs_total";
    /// Gauge: runs currently executing on this worker.
    pub const RUNS_ACTIVE: &str = "sb_runs_active";
    /// Histogram `{status}`: run duration from claim to terminal result.
    pub const RUN_DURATION_SECONDS: &str = "sb_run_duration_seconds";
    /// Histogram: ingest to first delivered result.
    pub const RUN_FIRST_RESULT_SECONDS: &str = "sb_run_first_result_seconds";
    /// Counter `{type}`: results persisted, by result type.
    pub const RUN_RESULTS_TOTAL: &str = "sb_run_results_total";
    /// Counter `{action, result}`: Host API calls; `result` is `ok` or an error code.
    pub const PROXY_CALLS_TOTAL: &str = "sb_proxy_calls_total";
    /// Histogram `{action}`: Host API call latency.
    pub const PROXY_CALL_DURATION_SECONDS: &str = "sb_proxy_call_duration_seconds";
    /// Counter `{exchange}`: messages published with a broker confirm.
    pub const BUS_PUBLISHED_TOTAL: &str = "sb_bus_published_total";
    /// Counter `{exchange}`: best-effort messages the bus refused for good (an invalid
    /// routing key, a body over the broker's limit) and that were dropped, not retried.
    pub const BUS_PUBLISH_REFUSED_TOTAL: &str = "sb_bus_publish_refused_total";
    /// Counter `{queue, disposition = ack|retry|dead_letter}`: messages consumed.
    pub const BUS_CONSUMED_TOTAL: &str = "sb_bus_consumed_total";
    /// Histogram `{queue}`: time between publish and consume (queue lag).
    pub const QUEUE_LAG_SECONDS: &str = "sb_queue_lag_seconds";
    /// Gauge: outbox rows committed but not yet published.
    pub const OUTBOX_PENDING: &str = "sb_outbox_pending";
    /// Gauge `{mode = shared|per_run}`: runner processes alive on this worker.
    pub const RUNNER_PROCESSES: &str = "sb_runner_processes";
    /// Counter `{reason = crashed|protocol_error}`: runner process restarts.
    pub const RUNNER_RESTARTS_TOTAL: &str = "sb_runner_restarts_total";
    /// Counter `{method, route, status}`: HTTP requests (route is the matched path template).
    pub const HTTP_REQUESTS_TOTAL: &str = "sb_http_requests_total";
    /// Histogram `{method, route}`: HTTP request latency.
    pub const HTTP_REQUEST_DURATION_SECONDS: &str = "sb_http_request_duration_seconds";
    /// Counter `{error_type, stage}`: errors worth alerting on (vector's convention; retried
    /// failures are not data loss and are counted under their own stage).
    pub const ERRORS_TOTAL: &str = "sb_errors_total";
}

/// The three Prometheus metric types we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic count.
    Counter,
    /// Value that goes up and down.
    Gauge,
    /// Distribution over [`LATENCY_BUCKETS`].
    Histogram,
}

impl MetricKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

/// A metric's name, kind and help text.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Prometheus name (one of [`names`]).
    pub name: &'static str,
    /// Type.
    pub kind: MetricKind,
    /// `# HELP` text.
    pub help: &'static str,
}

/// The known metrics. Names used without a definition still work; they render without help.
pub const DEFINITIONS: &[MetricDef] = &[
    def(
        names::EVENTS_INGESTED_TOTAL,
        MetricKind::Counter,
        "Events received by the API, by outcome.",
    ),
    def(
        names::EVENTS_ROUTED_TOTAL,
        MetricKind::Counter,
        "Events routed by the orchestrator, by outcome.",
    ),
    def(
        names::RUNS_TOTAL,
        MetricKind::Counter,
        "Runs that reached a terminal status, by status.",
    ),
    def(
        names::RUNS_ACTIVE,
        MetricKind::Gauge,
        "Runs currently executing on this worker.",
    ),
    def(
        names::RUN_DURATION_SECONDS,
        MetricKind::Histogram,
        "Run duration from claim to terminal result.",
    ),
    def(
        names::RUN_FIRST_RESULT_SECONDS,
        MetricKind::Histogram,
        "Time from ingest to the first delivered result.",
    ),
    def(
        names::RUN_RESULTS_TOTAL,
        MetricKind::Counter,
        "Run results persisted, by result type.",
    ),
    def(
        names::PROXY_CALLS_TOTAL,
        MetricKind::Counter,
        "Host API calls by action and result.",
    ),
    def(
        names::PROXY_CALL_DURATION_SECONDS,
        MetricKind::Histogram,
        "Host API call latency by action.",
    ),
    def(
        names::BUS_PUBLISHED_TOTAL,
        MetricKind::Counter,
        "Messages published and confirmed, by exchange.",
    ),
    def(
        names::BUS_PUBLISH_REFUSED_TOTAL,
        MetricKind::Counter,
        "Best-effort messages the bus refused for good and that were dropped, by exchange.",
    ),
    def(
        names::BUS_CONSUMED_TOTAL,
        MetricKind::Counter,
        "Messages consumed, by queue and disposition.",
    ),
    def(
        names::QUEUE_LAG_SECONDS,
        MetricKind::Histogram,
        "Time from publish to consume, by queue.",
    ),
    def(
        names::OUTBOX_PENDING,
        MetricKind::Gauge,
        "Outbox rows committed but not yet published.",
    ),
    def(
        names::RUNNER_PROCESSES,
        MetricKind::Gauge,
        "Runner processes alive on this worker, by mode.",
    ),
    def(
        names::RUNNER_RESTARTS_TOTAL,
        MetricKind::Counter,
        "Runner process restarts, by reason.",
    ),
    def(
        names::HTTP_REQUESTS_TOTAL,
        MetricKind::Counter,
        "HTTP requests by method, route and status.",
    ),
    def(
        names::HTTP_REQUEST_DURATION_SECONDS,
        MetricKind::Histogram,
        "HTTP request latency by method and route.",
    ),
    def(
        names::ERRORS_TOTAL,
        MetricKind::Counter,
        "Errors by type and stage.",
    ),
];

const fn def(name: &'static str, kind: MetricKind, help: &'static str) -> MetricDef {
    MetricDef { name, kind, help }
}

/// Histogram bucket bounds in seconds: 1 ms (the per-hop latency we aim for) up to 5 min (the
/// default run timeout).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Series per metric beyond which new label combinations are dropped: a guard against a
/// high-cardinality label slipping in, which would otherwise grow memory without bound.
pub const MAX_SERIES_PER_METRIC: usize = 1000;

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
enum Series {
    Counter(u64),
    Gauge(f64),
    Histogram {
        /// Non-cumulative counts per bucket of [`LATENCY_BUCKETS`]; values above the last bound
        /// are only in `count`.
        buckets: Vec<u64>,
        sum: f64,
        count: u64,
    },
}

#[derive(Debug)]
struct Family {
    kind: MetricKind,
    series: BTreeMap<Labels, Series>,
    overflowed: bool,
}

/// Counters, gauges and histograms keyed by name + labels, rendered in the Prometheus text
/// exposition format.
///
/// Using a name with a different kind than its first use (or its [`DEFINITIONS`] entry) is a
/// bug: the update is ignored and logged (and panics in debug builds).
///
/// ```
/// use sb_common::telemetry::{Registry, names};
/// let metrics = Registry::new();
/// metrics.inc(names::RUNS_TOTAL, &[("status", "completed")]);
/// assert!(metrics.render().contains("sb_runs_total{status=\"completed\"} 1\n"));
/// ```
#[derive(Debug, Default)]
pub struct Registry {
    families: Mutex<BTreeMap<&'static str, Family>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide registry that `GET /metrics` renders.
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Registry::new)
    }

    /// Adds 1 to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.add(name, labels, 1);
    }

    /// Adds `value` to a counter.
    pub fn add(&self, name: &'static str, labels: &[(&'static str, &str)], value: u64) {
        self.update(name, MetricKind::Counter, labels, |s| {
            if let Series::Counter(c) = s {
                *c = c.saturating_add(value);
            }
        });
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, labels: &[(&'static str, &str)], value: f64) {
        self.update(name, MetricKind::Gauge, labels, |s| {
            if let Series::Gauge(g) = s {
                *g = value;
            }
        });
    }

    /// Adds `delta` (may be negative) to a gauge.
    pub fn gauge_add(&self, name: &'static str, labels: &[(&'static str, &str)], delta: f64) {
        self.update(name, MetricKind::Gauge, labels, |s| {
            if let Series::Gauge(g) = s {
                *g += delta;
            }
        });
    }

    /// Records one observation (seconds for the latency histograms).
    pub fn observe(&self, name: &'static str, labels: &[(&'static str, &str)], value: f64) {
        self.update(name, MetricKind::Histogram, labels, |s| {
            if let Series::Histogram {
                buckets,
                sum,
                count,
            } = s
            {
                if let Some(i) = LATENCY_BUCKETS.iter().position(|bound| value <= *bound) {
                    buckets[i] += 1;
                }
                *sum += value;
                *count += 1;
            }
        });
    }

    fn update(
        &self,
        name: &'static str,
        kind: MetricKind,
        labels: &[(&'static str, &str)],
        apply: impl FnOnce(&mut Series),
    ) {
        let mut families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let family = families.entry(name).or_insert_with(|| Family {
            kind: DEFINITIONS
                .iter()
                .find(|d| d.name == name)
                .map_or(kind, |d| d.kind),
            series: BTreeMap::new(),
            overflowed: false,
        });
        if family.kind != kind {
            debug_assert!(
                false,
                "metric {name} is a {:?}, used as a {kind:?}",
                family.kind
            );
            tracing::warn!(
                metric = name,
                "metric used with the wrong kind; update ignored"
            );
            return;
        }
        let mut key: Labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        key.sort_unstable_by(|a, b| a.0.cmp(b.0));
        if !family.series.contains_key(&key) && family.series.len() >= MAX_SERIES_PER_METRIC {
            if !family.overflowed {
                family.overflowed = true;
                tracing::warn!(
                    metric = name,
                    limit = MAX_SERIES_PER_METRIC,
                    "too many label combinations; new series are dropped"
                );
            }
            return;
        }
        let series = family.series.entry(key).or_insert_with(|| match kind {
            MetricKind::Counter => Series::Counter(0),
            MetricKind::Gauge => Series::Gauge(0.0),
            MetricKind::Histogram => Series::Histogram {
                buckets: vec![0; LATENCY_BUCKETS.len()],
                sum: 0.0,
                count: 0,
            },
        });
        apply(series);
    }

    /// Current value of a counter (for tests and assertions).
    pub fn counter_value(&self, name: &str, labels: &[(&'static str, &str)]) -> Option<u64> {
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let mut key: Labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        key.sort_unstable_by(|a, b| a.0.cmp(b.0));
        match families.get(name)?.series.get(&key)? {
            Series::Counter(c) => Some(*c),
            _ => None,
        }
    }

    /// Everything in the Prometheus text exposition format (version 0.0.4), metrics sorted by
    /// name and series by labels, so the output is stable.
    pub fn render(&self) -> String {
        let families = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        for (name, family) in families.iter() {
            if let Some(def) = DEFINITIONS.iter().find(|d| d.name == *name) {
                let _ = writeln!(out, "# HELP {name} {}", def.help);
            }
            let _ = writeln!(out, "# TYPE {name} {}", family.kind.as_str());
            for (labels, series) in &family.series {
                match series {
                    Series::Counter(v) => {
                        let _ = writeln!(out, "{name}{} {v}", label_set(labels, None));
                    }
                    Series::Gauge(v) => {
                        let _ = writeln!(out, "{name}{} {}", label_set(labels, None), float(*v));
                    }
                    Series::Histogram {
                        buckets,
                        sum,
                        count,
                    } => {
                        let mut cumulative = 0;
                        for (bound, n) in LATENCY_BUCKETS.iter().zip(buckets) {
                            cumulative += n;
                            let le = float(*bound);
                            let _ = writeln!(
                                out,
                                "{name}_bucket{} {cumulative}",
                                label_set(labels, Some(&le))
                            );
                        }
                        let _ = writeln!(
                            out,
                            "{name}_bucket{} {count}",
                            label_set(labels, Some("+Inf"))
                        );
                        let _ =
                            writeln!(out, "{name}_sum{} {}", label_set(labels, None), float(*sum));
                        let _ = writeln!(out, "{name}_count{} {count}", label_set(labels, None));
                    }
                }
            }
        }
        out
    }
}

/// `{a="x",b="y"}` (with `le` last for histogram buckets), or nothing when there are no labels.
fn label_set(labels: &Labels, le: Option<&str>) -> String {
    if labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    format!("{{{}}}", parts.join(","))
}

fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Prometheus float syntax: `+Inf`, `-Inf`, `NaN`, otherwise Rust's shortest round-trip form.
fn float(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_definition_is_unique_and_follows_the_naming_rule() {
        let mut seen = std::collections::HashSet::new();
        for d in DEFINITIONS {
            assert!(seen.insert(d.name), "duplicate {}", d.name);
            assert!(d.name.starts_with("sb_"), "{}", d.name);
            match d.kind {
                MetricKind::Counter => assert!(d.name.ends_with("_total"), "{}", d.name),
                _ => assert!(!d.name.ends_with("_total"), "{}", d.name),
            }
            if d.kind == MetricKind::Histogram {
                assert!(d.name.ends_with("_seconds"), "{}", d.name);
            }
        }
    }

    #[test]
    fn counters_render_with_help_type_and_sorted_labels() {
        let r = Registry::new();
        r.inc(
            names::PROXY_CALLS_TOTAL,
            &[("result", "ok"), ("action", "invoke_llm")],
        );
        r.add(
            names::PROXY_CALLS_TOTAL,
            &[("action", "invoke_llm"), ("result", "ok")],
            2,
        );
        r.inc(
            names::PROXY_CALLS_TOTAL,
            &[("action", "call_tool"), ("result", "unauthorized")],
        );
        assert_eq!(
            r.counter_value(
                names::PROXY_CALLS_TOTAL,
                &[("result", "ok"), ("action", "invoke_llm")]
            ),
            Some(3)
        );
        assert_eq!(
            r.render(),
            "# HELP sb_proxy_calls_total Host API calls by action and result.\n\
             # TYPE sb_proxy_calls_total counter\n\
             sb_proxy_calls_total{action=\"call_tool\",result=\"unauthorized\"} 1\n\
             sb_proxy_calls_total{action=\"invoke_llm\",result=\"ok\"} 3\n"
        );
    }

    #[test]
    fn gauges_set_and_add() {
        let r = Registry::new();
        r.set(names::OUTBOX_PENDING, &[], 5.0);
        r.gauge_add(names::OUTBOX_PENDING, &[], -2.0);
        r.gauge_add(names::RUNS_ACTIVE, &[], 1.5);
        let text = r.render();
        assert!(
            text.contains("# TYPE sb_outbox_pending gauge\nsb_outbox_pending 3\n"),
            "{text}"
        );
        assert!(text.contains("sb_runs_active 1.5\n"), "{text}");
    }

    #[test]
    fn histograms_are_cumulative_with_inf_sum_and_count() {
        let r = Registry::new();
        for v in [0.0005, 0.003, 0.003, 1000.0] {
            r.observe(names::QUEUE_LAG_SECONDS, &[("queue", "events")], v);
        }
        let text = r.render();
        for line in [
            "# TYPE sb_queue_lag_seconds histogram",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.001\"} 1",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.0025\"} 1",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"0.005\"} 3",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"300\"} 3",
            "sb_queue_lag_seconds_bucket{queue=\"events\",le=\"+Inf\"} 4",
            "sb_queue_lag_seconds_sum{queue=\"events\"} 1000.0065",
            "sb_queue_lag_seconds_count{queue=\"events\"} 4",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing `{line}` in\n{text}"
            );
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let r = Registry::new();
        r.inc(
            names::ERRORS_TOTAL,
            &[("error_type", "a\"b\\c\nd"), ("stage", "x")],
        );
        assert!(
            r.render()
                .contains("sb_errors_total{error_type=\"a\\\"b\\\\c\\nd\",stage=\"x\"} 1\n")
        );
    }

    #[test]
    fn undefined_names_render_without_help() {
        let r = Registry::new();
        r.inc("sb_custom_things_total", &[]);
        assert_eq!(
            r.render(),
            "# TYPE sb_custom_things_total counter\nsb_custom_things_total 1\n"
        );
    }

    #[test]
    fn series_beyond_the_cap_are_dropped() {
        let r = Registry::new();
        for i in 0..MAX_SERIES_PER_METRIC + 10 {
            r.inc(names::RUNS_TOTAL, &[("status", &i.to_string())]);
        }
        r.inc(names::RUNS_TOTAL, &[("status", "0")]);
        assert_eq!(
            r.counter_value(names::RUNS_TOTAL, &[("status", "0")]),
            Some(2)
        );
        assert_eq!(
            r.counter_value(names::RUNS_TOTAL, &[("status", "1005")]),
            None
        );
        let series = r
            .render()
            .lines()
            .filter(|l| l.starts_with("sb_runs_total{"))
            .count();
        assert_eq!(series, MAX_SERIES_PER_METRIC);
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "used as a"))]
    fn wrong_kind_is_ignored() {
        let r = Registry::new();
        r.inc(names::RUNS_ACTIVE, &[]);
        assert!(!r.render().lines().any(|l| l.starts_with("sb_runs_active")));
    }

    #[test]
    fn filters_parse_or_are_rejected() {
        parse_filter("info,sb_worker=debug").unwrap();
        assert!(matches!(
            parse_filter("info,=["),
            Err(TelemetryError::InvalidFilter { .. })
        ));
    }
}
