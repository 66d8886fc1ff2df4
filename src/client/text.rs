//! The text of a run's results, as a client shows it: `message.delta` chunks and completed
//! messages, read leniently (a string, or the `text` blocks of a block list).

use sb_protocol::result::AgentRunResult;
use serde_json::Value;

/// The text of a `message.delta` chunk.
#[must_use]
pub fn delta_text(result: &AgentRunResult) -> Option<String> {
    result.data.get("chunk")?.get("content").map(content_text)
}

/// The text of the message of a `message.completed` or `run.completed` (`None` when there
/// is no message).
#[must_use]
pub fn message_text(result: &AgentRunResult) -> Option<String> {
    let message = result.data.get("message").filter(|m| !m.is_null())?;
    Some(message.get("content").map(content_text).unwrap_or_default())
}

/// A message `content`: a string, or the `text` blocks of a block list joined in order.
/// Read leniently: a client shows what it understands and skips the rest.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_read_from_strings_and_text_blocks() {
        let r: AgentRunResult =
            serde_json::from_value(serde_json::json!({"type": "message.completed",
            "data": {"message": {"role": "assistant", "content": [{"type": "text", "text": "a"},
            {"type": "image", "url": "x"}, {"type": "text", "text": "b"}]}}}))
            .unwrap();
        assert_eq!(message_text(&r).as_deref(), Some("ab"));
        assert_eq!(delta_text(&r), None);
        let r: AgentRunResult = serde_json::from_value(serde_json::json!({"type": "message.delta",
            "data": {"chunk": {"role": "assistant", "content": "hel"}}}))
        .unwrap();
        assert_eq!(delta_text(&r).as_deref(), Some("hel"));
    }
}
