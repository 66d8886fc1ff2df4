//! `GET /v1/runners`: the runners workers have registered (global, not per workspace:
//! runners are installed on workers, agents in workspaces refer to them).

use axum::extract::State;
use serde::Serialize;
use serde_json::Value;

use super::{Items, epoch};
use crate::auth::Caller;
use crate::error::{ApiJson, ApiResult};
use crate::state::AppState;

/// A registered runner.
#[derive(Debug, Serialize)]
pub struct RunnerView {
    /// `plugin:<author>/<plugin>/<runner>`.
    pub runner_id: String,
    /// `<author>/<plugin>`.
    pub plugin_id: String,
    /// Worker pool hosting it.
    pub pool: String,
    /// Plugin version.
    pub version: String,
    /// The descriptor: label, description, capabilities, permissions, config schema.
    pub descriptor: Value,
    /// Last announcement by a worker, epoch seconds.
    pub seen_at: i64,
}

/// `GET /v1/runners`, by id.
pub async fn list_runners(
    State(state): State<AppState>,
    _caller: Caller,
) -> ApiResult<ApiJson<Items<RunnerView>>> {
    let rows = state.stores().runners.list().await?;
    Ok(ApiJson(Items {
        items: rows
            .into_iter()
            .map(|r| RunnerView {
                runner_id: r.id,
                plugin_id: r.plugin_id,
                pool: r.pool,
                version: r.version,
                descriptor: r.descriptor,
                seen_at: epoch(r.seen_at),
            })
            .collect(),
    }))
}
