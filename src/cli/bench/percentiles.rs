//! Latency percentiles of the bench's histograms (microsecond samples, reported in
//! milliseconds), shared by the report and the host stages.

use hdrhistogram::Histogram;
use serde_json::{Value, json};

/// Highest latency the histograms record (longer ones are clamped): one hour, in µs.
pub const MAX_LATENCY_US: u64 = 3_600_000_000;

/// A histogram of microsecond samples up to [`MAX_LATENCY_US`], three significant digits.
#[must_use]
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds")
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
    /// The percentiles of `h`, whose samples are microseconds.
    pub fn of(h: &Histogram<u64>) -> Self {
        let at = |q: f64| (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0);
        Self {
            p50: at(0.50),
            p95: at(0.95),
            p99: at(0.99),
        }
    }

    /// The `--json` form: `{"p50", "p95", "p99"}` in milliseconds, each `null` without
    /// samples.
    #[must_use]
    pub fn to_json(self) -> Value {
        json!({"p50": self.p50, "p95": self.p95, "p99": self.p99})
    }
}
