//! `history_page` and `history_search`: the run's conversation transcript, as the
//! `TranscriptItem` projection (never raw platform payloads, never run or runner ids).
//!
//! Scope (host-behaviour §22.1): a run reads only its own conversation, in its own workspace,
//! bot (when it has one) and thread (strictly: a run outside any thread sees only items
//! without a thread). A run without a conversation gets an empty page.

use sb_protocol::error::AgentApiError;
use sb_protocol::host::AuthorizationSnapshot;
use sb_protocol::proxy::{HistoryPage, HistorySearchResult, TranscriptItem};
use sb_store::ThreadFilter;
use sb_store::transcript::{Direction, TranscriptQuery, TranscriptRecord, TranscriptSearch};
use serde_json::{Map, Value};

use super::params::{page_limit, str_list};
use super::{ActionDispatcher, Cx, answer, api_not_granted, invalid, store_error, unauthorized};

/// The conversation rule shared by history and event reads: a requested conversation must
/// be the run's own; none requested means the run's (which may be none at all).
pub(crate) fn resolve_conversation(
    snapshot: &AuthorizationSnapshot,
    requested: Option<&str>,
    api_name: &str,
) -> Result<Option<String>, AgentApiError> {
    match (requested, snapshot.conversation_id.as_deref()) {
        (Some(_), None) => Err(unauthorized(format!(
            "{api_name} is not available without a run conversation"
        ))),
        (Some(wanted), Some(own)) if wanted != own => Err(unauthorized(format!(
            "conversation {wanted} is not accessible by this run"
        ))),
        (_, own) => Ok(own.map(str::to_owned)),
    }
}

/// The strict thread filter of a run.
pub(crate) fn thread_of(snapshot: &AuthorizationSnapshot) -> ThreadFilter {
    ThreadFilter::Exactly(snapshot.thread_id.clone())
}

fn object(value: Option<Value>) -> Option<Map<String, Value>> {
    match value {
        Some(Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// The runner-visible projection of a transcript row (run and runner ids are host-only).
pub(crate) fn transcript_item(record: TranscriptRecord, include_artifacts: bool) -> TranscriptItem {
    let artifact_refs = match (include_artifacts, record.artifact_refs) {
        (true, Some(Value::Array(refs))) => refs
            .into_iter()
            .filter_map(|r| match r {
                Value::Object(map) => Some(map),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    TranscriptItem {
        transcript_id: record.id,
        event_id: record.event_id,
        conversation_id: Some(record.conversation_id),
        thread_id: record.thread_id,
        role: record.role,
        item_type: record.item_type,
        content: record.content,
        content_json: object(record.content_json),
        artifact_refs,
        seq: Some(record.seq),
        cursor: Some(record.cursor),
        created_at: Some(record.created_at.timestamp()),
        metadata: object(Some(record.metadata)).unwrap_or_default(),
    }
}

impl ActionDispatcher {
    pub(super) async fn history_page(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4
        if !snap.available_apis.history_page {
            return Err(api_not_granted("history page"));
        }
        // 5
        let conversation =
            resolve_conversation(snap, p.opt_str("conversation_id")?, "history page")?;
        // 6
        let before_cursor = p.opt_str("before_cursor")?.map(str::to_owned);
        let after_cursor = p.opt_str("after_cursor")?.map(str::to_owned);
        let limit = page_limit(
            p,
            "limit",
            self.limits.page_size_default,
            self.limits.page_size_max,
        )?;
        let direction = match p.opt_str("direction")? {
            None | Some("backward") => Direction::Backward,
            Some("forward") => Direction::Forward,
            Some(other) => {
                return Err(invalid(format!(
                    "direction must be backward or forward, not {other}"
                )));
            }
        };
        let include_artifacts = p.opt_bool("include_artifacts")?.unwrap_or(false);
        // 7
        self.admit(cx).await?;

        let Some(conversation_id) = conversation else {
            return answer(&HistoryPage::default());
        };
        let query = TranscriptQuery {
            workspace_id: snap.workspace_id.clone(),
            conversation_id,
            thread: thread_of(snap),
            bot_id: snap.bot_id.clone(),
            before_cursor,
            after_cursor,
            limit: Some(limit),
            direction,
        };
        let page = self
            .stores
            .transcript
            .page(query)
            .await
            .map_err(|e| store_error(&e))?;
        answer(&HistoryPage {
            items: page
                .items
                .into_iter()
                .map(|r| transcript_item(r, include_artifacts))
                .collect(),
            next_cursor: page.next_cursor,
            prev_cursor: page.prev_cursor,
            has_more: page.has_more,
            total_count: None,
        })
    }

    pub(super) async fn history_search(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4
        if !snap.available_apis.history_search {
            return Err(api_not_granted("history search"));
        }
        // 5: a filter naming another conversation is refused, not ignored.
        let filters = p.opt_object("filters")?;
        let requested = match filters.and_then(|f| f.get("conversation_id")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(_) => return Err(invalid("filters.conversation_id must be a string")),
        };
        let conversation = resolve_conversation(snap, requested, "history search")?;
        // 6
        let query = p.req_str("query")?;
        if query.trim().is_empty() {
            return Err(invalid("query is required"));
        }
        let (mut roles, mut item_types) = (Vec::new(), Vec::new());
        if let Some(filters) = filters {
            for (key, value) in filters {
                match key.as_str() {
                    "conversation_id" => {}
                    "roles" => roles = str_list(Some(value), "filters.roles")?,
                    "item_types" => item_types = str_list(Some(value), "filters.item_types")?,
                    other => {
                        return Err(invalid(format!(
                            "unknown history search filter `{other}` (allowed: conversation_id, roles, item_types)"
                        )));
                    }
                }
            }
        }
        let top_k = page_limit(
            p,
            "top_k",
            self.limits.search_top_k_default,
            self.limits.page_size_max,
        )?;
        // 7
        self.admit(cx).await?;

        let Some(conversation_id) = conversation else {
            return answer(&HistorySearchResult {
                items: Vec::new(),
                total_count: Some(0),
                query: query.to_owned(),
            });
        };
        let search = TranscriptSearch {
            workspace_id: snap.workspace_id.clone(),
            conversation_id,
            thread: thread_of(snap),
            bot_id: snap.bot_id.clone(),
            query: query.to_owned(),
            roles,
            item_types,
            top_k: Some(top_k),
        };
        let found = self
            .stores
            .transcript
            .search(search)
            .await
            .map_err(|e| store_error(&e))?;
        let items: Vec<TranscriptItem> = found
            .into_iter()
            .map(|r| transcript_item(r, true))
            .collect();
        answer(&HistorySearchResult {
            total_count: Some(items.len() as u64),
            items,
            query: query.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(conversation: Option<&str>) -> AuthorizationSnapshot {
        serde_json::from_value(json!({
            "run_id": sb_protocol::ids::RunId::new(), "plugin_id": "a/b", "runner_id": "plugin:a/b/c",
            "binding_id": "x", "workspace_id": "default", "conversation_id": conversation,
            "resources": {}, "available_apis": {}, "state_policy": {}, "budgets": {}
        }))
        .unwrap()
    }

    #[test]
    fn conversation_rule() {
        let with = snapshot(Some("c1"));
        assert_eq!(
            resolve_conversation(&with, None, "history page")
                .unwrap()
                .as_deref(),
            Some("c1")
        );
        assert_eq!(
            resolve_conversation(&with, Some("c1"), "history page")
                .unwrap()
                .as_deref(),
            Some("c1")
        );
        let e = resolve_conversation(&with, Some("c2"), "history page").unwrap_err();
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            (
                "unauthorized",
                "conversation c2 is not accessible by this run"
            )
        );
        let without = snapshot(None);
        assert_eq!(
            resolve_conversation(&without, None, "history page").unwrap(),
            None
        );
        let e = resolve_conversation(&without, Some("c1"), "event page").unwrap_err();
        assert_eq!(
            e.message,
            "event page is not available without a run conversation"
        );
    }
}
