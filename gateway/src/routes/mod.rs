//! Handlers, one file per resource. Shared helpers for views live here.

pub mod agents;
pub mod conversations;
pub mod events;
pub mod health;
pub mod host;
pub mod keys;
pub mod resources;
pub mod runners;
pub mod runs;
pub mod schedules;
pub mod sessions;
pub mod turns;

use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::ApiError;

/// A page of a list endpoint: `{items, next_cursor, has_more}`. `next_cursor` is opaque and
/// set only when `has_more`.
#[derive(Debug, Serialize)]
pub struct ListPage<T> {
    /// The items.
    pub items: Vec<T>,
    /// Pass as `cursor` (or `after_sequence` for run events) to get the next page.
    pub next_cursor: Option<String>,
    /// More items exist past this page.
    pub has_more: bool,
}

/// A list without paging: `{items}`.
#[derive(Debug, Serialize)]
pub struct Items<T> {
    /// The items.
    pub items: Vec<T>,
}

/// Timestamps on the wire are epoch seconds (DESIGN-NOTES, Time).
pub(crate) fn epoch(at: DateTime<Utc>) -> i64 {
    at.timestamp()
}

/// Parses a path id. A malformed id cannot name anything: `404` with the usual message, so
/// probing ids reveals nothing about their format rules beyond "not found".
pub(crate) fn parse_id<T: FromStr>(what: &str, id: &str) -> Result<T, ApiError> {
    id.parse()
        .map_err(|_| ApiError::not_found(format!("{what} {id} not found")))
}
