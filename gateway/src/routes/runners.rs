//! `GET /v1/runners`: the runners workers have registered (global, not per workspace:
//! runners are installed on workers, agents in workspaces refer to them).

use axum::extract::State;
use serde::Serialize;
use serde_json::Value;

use super::{ListPage, PageQuery, epoch, page_by_key};
use crate::auth::Caller;
use crate::error::{ApiJson, ApiQuery, ApiResult};
use crate::state::AppState;

/// A registered runner.
#[derive(Debug, Serialize, utoipa::ToSchema)]
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
#[utoipa::path(
    get,
    path = "/v1/runners",
    tag = "runners",
    params(PageQuery),
    responses(
        (status = 200, description = "Registered runners, by id", body = ListPage<RunnerView>),
    )
)]
pub async fn list_runners(
    State(state): State<AppState>,
    _caller: Caller,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<ApiJson<ListPage<RunnerView>>> {
    let rows = state.stores().runners.list().await?;
    let items: Vec<RunnerView> = rows
        .into_iter()
        .map(|r| RunnerView {
            runner_id: r.id,
            plugin_id: r.plugin_id,
            pool: r.pool,
            version: r.version,
            descriptor: r.descriptor,
            seen_at: epoch(r.seen_at),
        })
        .collect();
    Ok(ApiJson(page_by_key(
        items,
        |r| r.runner_id.clone(),
        q.cursor.as_deref(),
        state.page_limit(q.limit),
    )?))
}
