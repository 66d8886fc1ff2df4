//! Redaction of persisted copies of inputs (host-behaviour §14).
//!
//! Whatever the host persists about an input — a transcript row, an event-log audit row —
//! never keeps inline payloads: an image block's `base64` / `data` (and a `data:` URL) and an
//! attachment's `content_base64` / `content` become `null` with `content_redacted: true`.
//! The runner still received them whole in its context or steering item; only the stored
//! copy is redacted. The orchestrator's journal and the audit builders ([`crate::audit`])
//! share these two functions so every stored copy is redacted the same way.

use serde_json::{Map, Value};

fn redact_inline(obj: &mut Map<String, Value>, field: &str) {
    if obj.get(field).is_some_and(|v| !v.is_null()) {
        obj.insert(field.to_owned(), Value::Null);
        obj.insert("content_redacted".to_owned(), Value::Bool(true));
    }
}

/// Redacts inline payloads from a list of content blocks (JSON). Anything but an array is
/// returned unchanged.
#[must_use]
pub fn sanitize_contents(contents: Value) -> Value {
    let Value::Array(mut items) = contents else {
        return contents;
    };
    for item in &mut items {
        let Some(obj) = item.as_object_mut() else {
            continue;
        };
        let kind = obj
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if kind == "image" || kind == "image_base64" || kind == "file_base64" {
            redact_inline(obj, "base64");
            redact_inline(obj, "data");
            if obj
                .get("url")
                .and_then(Value::as_str)
                .is_some_and(|u| u.starts_with("data:"))
            {
                redact_inline(obj, "url");
            }
        }
    }
    Value::Array(items)
}

/// Redacts inline payloads from attachment refs (JSON). Anything but an array is returned
/// unchanged.
#[must_use]
pub fn sanitize_attachments(attachments: Value) -> Value {
    let Value::Array(mut items) = attachments else {
        return attachments;
    };
    for item in &mut items {
        if let Some(obj) = item.as_object_mut() {
            redact_inline(obj, "content_base64");
            redact_inline(obj, "content");
        }
    }
    Value::Array(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inline_payloads_are_redacted_and_marked() {
        let contents = sanitize_contents(json!([
            {"type": "text", "text": "hi"},
            {"type": "image", "base64": "AAAA", "mime_type": "image/png"},
            {"type": "image", "url": "data:image/png;base64,AAAA"},
            {"type": "image", "url": "https://example.com/a.png"},
        ]));
        assert_eq!(contents[0], json!({"type": "text", "text": "hi"}));
        assert_eq!(contents[1]["base64"], Value::Null);
        assert_eq!(contents[1]["content_redacted"], true);
        assert_eq!(contents[1]["mime_type"], "image/png");
        assert_eq!(contents[2]["url"], Value::Null);
        assert_eq!(contents[2]["content_redacted"], true);
        assert_eq!(
            contents[3],
            json!({"type": "image", "url": "https://example.com/a.png"}),
            "a remote url is kept"
        );

        let refs = sanitize_attachments(json!([
            {"artifact_id": "a1", "content_base64": "AAAA"},
            {"artifact_id": "a2"},
        ]));
        assert_eq!(refs[0]["content_base64"], Value::Null);
        assert_eq!(refs[0]["content_redacted"], true);
        assert_eq!(refs[1], json!({"artifact_id": "a2"}));

        assert_eq!(sanitize_contents(Value::Null), Value::Null);
        assert_eq!(sanitize_attachments(json!("x")), json!("x"));
    }
}
