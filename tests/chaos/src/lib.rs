//! The chaos suite (issue 15): faults injected into a multi-process cluster, measured from
//! outside as an operator would, against the guarantees of SPEC §2 and §11.
//!
//! A 1 + 2 + 2 cluster (one gateway, two orchestrators, two workers, each its own
//! `switchboard` process, [`sb_tests::cluster`]) runs on the suite's **own** RabbitMQ, Redis
//! and Postgres ([`services`]), so that killing and restarting them never disturbs the
//! shared services the other suites use. Each scenario ([`scenarios`]) puts a bounded load
//! on it ([`load`]: events at a fixed rate, one stream follower per event that resumes
//! across disconnects), injects one fault halfway, measures the recovery, heals the fault,
//! and judges what the API shows afterwards ([`check`]): every accepted event has exactly
//! one run, every run is terminal with exactly one terminal item, no sequence gaps, no
//! second execution, every follower saw a dense stream.
//!
//! # Why a crate of its own
//! It owns processes the other suites must never see (three servers, a cluster restarted
//! piece by piece) and runs for minutes, so it is its own workspace member with its own
//! test binary rather than one more file in `sb-tests`: `cargo nextest run -p sb-chaos`
//! runs it alone, its nextest timeout is its own, and it reuses the cluster harness as a
//! library instead of copying it. It is not a default member (`cargo run` does not build
//! it); `scripts/test` runs it through the workspace's nextest run.
//!
//! # Profiles
//! | `SWITCHBOARD_CHAOS` | load per scenario | where |
//! | --- | --- | --- |
//! | `short` (default) | 12 events at 6/s, runs of 300 deltas (1.5 s) | `scripts/test` |
//! | `full` | 150 events at 10/s, runs of 300 deltas (1.5 s) | `scripts/chaos`, the README's figures |
//!
//! `SWITCHBOARD_CHAOS_SCENARIOS=kill_worker,restart_redis` runs a subset;
//! `SWITCHBOARD_CHAOS_EVENTS` and `SWITCHBOARD_CHAOS_RATE` override the load. Every
//! scenario's report is written as JSON to `target/chaos/<profile>/<scenario>.json`, all of
//! them to `summary.json`, and the README's table to `summary.md`.
//!
//! The suite is skipped only when a service binary is missing and
//! `SWITCHBOARD_TEST_REQUIRE_SERVICES` is unset.

pub mod check;
pub mod load;
pub mod scenarios;
pub mod services;

use std::path::PathBuf;
use std::time::Duration;

use scenarios::{Fault, Load, ScenarioReport};

/// The profile variable.
pub const PROFILE_VAR: &str = "SWITCHBOARD_CHAOS";

/// A named load and the scenarios to run.
#[derive(Debug, Clone)]
pub struct Profile {
    /// `short` or `full`.
    pub name: String,
    /// The load of every scenario.
    pub load: Load,
    /// The scenarios, in order.
    pub faults: Vec<Fault>,
}

impl Profile {
    /// From the environment (see the crate docs).
    pub fn from_env() -> Result<Self, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let name = var(PROFILE_VAR).unwrap_or_else(|| "short".to_owned());
        let mut load = match name.as_str() {
            "short" => Load {
                events: 12,
                rate: 6.0,
                deltas: 300,
                deadline: Duration::from_secs(90),
            },
            "full" => Load {
                events: 150,
                rate: 10.0,
                deltas: 300,
                deadline: Duration::from_secs(240),
            },
            other => return Err(format!("{PROFILE_VAR}={other}: expected short or full")),
        };
        if let Some(events) = var("SWITCHBOARD_CHAOS_EVENTS") {
            load.events = events
                .parse()
                .map_err(|_| format!("SWITCHBOARD_CHAOS_EVENTS={events}"))?;
        }
        if let Some(rate) = var("SWITCHBOARD_CHAOS_RATE") {
            load.rate = rate
                .parse()
                .map_err(|_| format!("SWITCHBOARD_CHAOS_RATE={rate}"))?;
        }
        let faults = match var("SWITCHBOARD_CHAOS_SCENARIOS") {
            None => Fault::ALL.to_vec(),
            Some(list) => list
                .split(',')
                .map(|n| {
                    Fault::ALL
                        .into_iter()
                        .find(|f| f.name() == n.trim())
                        .ok_or_else(|| format!("unknown chaos scenario {n:?}"))
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(Self { name, load, faults })
    }

    /// `target/chaos/<profile>`.
    #[must_use]
    pub fn output_dir(&self) -> PathBuf {
        let target = sb_tests::target_dir();
        target
            .parent()
            .unwrap_or(&target)
            .join("chaos")
            .join(&self.name)
    }
}

/// The README's table of `reports`.
#[must_use]
pub fn markdown_table(reports: &[ScenarioReport]) -> String {
    let mut out = String::from(
        "| scenario | events accepted | runs | lost | duplicated | gaps | stuck | two terminal items | second executions | follower gaps | not completed | recovery (s) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in reports {
        let t = &r.tally;
        let recovery = r
            .recovery_seconds
            .map_or_else(|| "—".to_owned(), |s| format!("{s:.1}"));
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.scenario,
            t.accepted,
            t.runs,
            t.lost,
            t.duplicated,
            t.gaps,
            t.stuck,
            t.terminal_items,
            t.second_executions,
            t.follower_gaps,
            t.not_completed(),
            recovery
        ));
    }
    out
}
