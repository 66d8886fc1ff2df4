//! Data shapes returned by the Host API (PROTOCOL_V1 §8).
//!
//! History is a transcript *projection*, never raw platform payloads; events are the stable
//! envelope plus a bounded raw ref. Cursors are opaque tokens: runners must not parse or
//! compare them across APIs, conversations or retention windows.
//!
//! Optional fields are written as explicit `null`, as the Python host does.
//!
//! ```
//! use sb_protocol::proxy::HistoryPage;
//! let page: HistoryPage = serde_json::from_str(r#"{"items": [
//!     {"transcript_id": "t1", "event_id": "e1", "role": "user", "content": "hi"}]}"#).unwrap();
//! assert_eq!(page.items[0].item_type, "message");
//! assert!(!page.has_more);
//! ```

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::content::ArtifactRef;
use crate::context::{ActorContext, AgentEventContext, AgentInput, SubjectContext};

fn message_item() -> String {
    "message".to_owned()
}

/// One transcript row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TranscriptItem {
    /// Transcript id.
    pub transcript_id: String,
    /// Event the row belongs to.
    pub event_id: String,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// `user`, `assistant`, …
    pub role: String,
    /// Row kind, default `message`.
    #[serde(default = "message_item")]
    pub item_type: String,
    /// Plain text (capped at 4000 chars).
    #[serde(default)]
    pub content: Option<String>,
    /// Full structured content.
    #[serde(default)]
    pub content_json: Option<Map<String, Value>>,
    /// Attached artifact refs (dicts).
    #[serde(default)]
    pub artifact_refs: Vec<Map<String, Value>>,
    /// Transcript sequence.
    #[serde(default)]
    pub seq: Option<i64>,
    /// Opaque cursor of this row.
    #[serde(default)]
    pub cursor: Option<String>,
    /// Epoch seconds.
    #[serde(default)]
    pub created_at: Option<i64>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// A page of history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HistoryPage {
    /// Rows.
    #[serde(default)]
    pub items: Vec<TranscriptItem>,
    /// Cursor for the next page.
    #[serde(default)]
    pub next_cursor: Option<String>,
    /// Cursor for the previous page.
    #[serde(default)]
    pub prev_cursor: Option<String>,
    /// Whether more rows exist in the paging direction.
    #[serde(default)]
    pub has_more: bool,
    /// Total rows, if known.
    #[serde(default)]
    pub total_count: Option<u64>,
}

/// History search results.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistorySearchResult {
    /// Matching rows.
    #[serde(default)]
    pub items: Vec<TranscriptItem>,
    /// Total matches, if known.
    #[serde(default)]
    pub total_count: Option<u64>,
    /// The query as run.
    pub query: String,
}

/// One event-log row as a runner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEventRecord {
    /// Event id.
    pub event_id: String,
    /// Stable type.
    pub event_type: String,
    /// Epoch seconds.
    #[serde(default)]
    pub event_time: Option<i64>,
    /// Source.
    pub source: String,
    /// Bot.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Workspace.
    #[serde(default)]
    pub workspace_id: Option<String>,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Actor type.
    #[serde(default)]
    pub actor_type: Option<String>,
    /// Actor id.
    #[serde(default)]
    pub actor_id: Option<String>,
    /// Actor name.
    #[serde(default)]
    pub actor_name: Option<String>,
    /// Subject type.
    #[serde(default)]
    pub subject_type: Option<String>,
    /// Subject id.
    #[serde(default)]
    pub subject_id: Option<String>,
    /// Input text summary (≤ 1000 chars).
    #[serde(default)]
    pub input_summary: Option<String>,
    /// Reference to the full input.
    #[serde(default)]
    pub input_ref: Option<String>,
    /// Reference to the raw payload.
    #[serde(default)]
    pub raw_ref: Option<String>,
    /// Event-log sequence.
    #[serde(default)]
    pub seq: Option<i64>,
    /// Opaque cursor.
    #[serde(default)]
    pub cursor: Option<String>,
    /// Epoch seconds.
    #[serde(default)]
    pub created_at: Option<i64>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// A page of events.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventPage {
    /// Rows.
    #[serde(default)]
    pub items: Vec<AgentEventRecord>,
    /// Cursor for the next page.
    #[serde(default)]
    pub next_cursor: Option<String>,
    /// Cursor for the previous page.
    #[serde(default)]
    pub prev_cursor: Option<String>,
    /// Whether more rows exist.
    #[serde(default)]
    pub has_more: bool,
    /// Total rows, if known.
    #[serde(default)]
    pub total_count: Option<u64>,
}

/// Artifact metadata (host-only fields such as storage keys are never included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactMetadata {
    /// Id.
    pub artifact_id: String,
    /// Kind.
    pub artifact_type: String,
    /// MIME type.
    #[serde(default)]
    pub mime_type: Option<String>,
    /// Name.
    #[serde(default)]
    pub name: Option<String>,
    /// Size in bytes.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Hex SHA-256.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Origin (`platform`, `runner`, …).
    pub source: String,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Producing run.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Producing runner.
    #[serde(default)]
    pub runner_id: Option<String>,
    /// Epoch seconds.
    #[serde(default)]
    pub created_at: Option<i64>,
    /// Epoch seconds.
    #[serde(default)]
    pub expires_at: Option<i64>,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

/// A (range) read of an artifact. Content is inline base64 or, for external artifacts, a
/// `file_key`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactReadResult {
    /// Id.
    pub artifact_id: String,
    /// MIME type.
    #[serde(default)]
    pub mime_type: Option<String>,
    /// Total size in bytes.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Offset of this read.
    #[serde(default)]
    pub offset: u64,
    /// Bytes returned.
    #[serde(default)]
    pub length: Option<u64>,
    /// The bytes, base64.
    #[serde(default)]
    pub content_base64: Option<String>,
    /// External location.
    #[serde(default)]
    pub file_key: Option<String>,
    /// Whether bytes remain after this range.
    #[serde(default)]
    pub has_more: bool,
}

/// Conversation scope carried by a steering item.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SteeringConversation {
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Bot.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Workspace.
    #[serde(default)]
    pub workspace_id: Option<String>,
}

/// One follow-up event claimed by an active run, as returned by `steering_pull`
/// (host-behaviour §11).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SteeringItem {
    /// The run that claimed it.
    pub claimed_run_id: String,
    /// That run's runner.
    pub runner_id: String,
    /// Epoch seconds.
    pub claimed_at: i64,
    /// The claimed event.
    pub event: AgentEventContext,
    /// Its conversation scope.
    #[serde(default)]
    pub conversation: SteeringConversation,
    /// Its actor.
    #[serde(default)]
    pub actor: Option<ActorContext>,
    /// Its subject.
    #[serde(default)]
    pub subject: Option<SubjectContext>,
    /// Its input.
    pub input: AgentInput,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

impl SteeringItem {
    /// The attachments of the claimed input.
    #[must_use]
    pub fn attachments(&self) -> &[ArtifactRef] {
        &self.input.attachments
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn proxy_shapes_roundtrip_with_all_fields() {
        let item = json!({
            "transcript_id": "t", "event_id": "e", "conversation_id": "c", "thread_id": null,
            "role": "assistant", "item_type": "message", "content": "hi",
            "content_json": {"role": "assistant", "content": "hi"},
            "artifact_refs": [{"artifact_id": "a"}], "seq": 4, "cursor": "4",
            "created_at": 1700000000, "metadata": {"run_id": "r"}
        });
        let page = json!({"items": [item.clone()], "next_cursor": "4", "prev_cursor": null,
                          "has_more": true, "total_count": 10});
        let p: HistoryPage = serde_json::from_value(page.clone()).unwrap();
        assert_eq!(serde_json::to_value(&p).unwrap(), page);
        let s = json!({"items": [item], "total_count": 1, "query": "hi"});
        let r: HistorySearchResult = serde_json::from_value(s.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), s);

        let ev = json!({
            "event_id": "e", "event_type": "message.received", "event_time": 1, "source": "api",
            "bot_id": "b", "workspace_id": "w", "conversation_id": "c", "thread_id": "t",
            "actor_type": "user", "actor_id": "u", "actor_name": "U", "subject_type": "message",
            "subject_id": "m", "input_summary": "hi", "input_ref": "i", "raw_ref": "r",
            "seq": 1, "cursor": "1", "created_at": 2, "metadata": {}
        });
        let ep = json!({"items": [ev], "next_cursor": null, "prev_cursor": "1",
                        "has_more": false, "total_count": null});
        let e: EventPage = serde_json::from_value(ep.clone()).unwrap();
        assert_eq!(serde_json::to_value(&e).unwrap(), ep);

        let meta = json!({
            "artifact_id": "a", "artifact_type": "image", "mime_type": "image/png", "name": "x.png",
            "size_bytes": 3, "sha256": "ab", "source": "runner", "conversation_id": "c",
            "run_id": "r", "runner_id": "plugin:a/b/c", "created_at": 1, "expires_at": null,
            "metadata": {}
        });
        let m: ArtifactMetadata = serde_json::from_value(meta.clone()).unwrap();
        assert_eq!(serde_json::to_value(&m).unwrap(), meta);

        let read = json!({"artifact_id": "a", "mime_type": null, "size_bytes": 3, "offset": 0,
                          "length": 3, "content_base64": "YWJj", "file_key": null, "has_more": false});
        let rr: ArtifactReadResult = serde_json::from_value(read.clone()).unwrap();
        assert_eq!(serde_json::to_value(&rr).unwrap(), read);
    }

    #[test]
    fn required_fields_are_required() {
        assert!(
            serde_json::from_value::<TranscriptItem>(json!({"transcript_id": "t", "role": "user"}))
                .is_err()
        );
        assert!(serde_json::from_value::<HistorySearchResult>(json!({"items": []})).is_err());
        assert!(
            serde_json::from_value::<ArtifactMetadata>(
                json!({"artifact_id": "a", "artifact_type": "x"})
            )
            .is_err()
        );
    }
}
