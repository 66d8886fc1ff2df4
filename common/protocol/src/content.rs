//! Message content: typed content blocks, messages and streaming chunks.
//!
//! A message's `content` is either a plain string or an ordered list of blocks (seed 001:
//! "block order is the order the model produced them and the UI shows them"):
//!
//! | `type` | fields |
//! | --- | --- |
//! | `text` | `text` |
//! | `image` | at least one of `url`, `base64`, `artifact_id`; optional `mime_type`, `detail` |
//! | `reasoning` | `text` (thinking the provider allows to be shown) |
//! | `tool_call` | `id`, `name`, `arguments` (a JSON object) |
//! | `tool_result` | `tool_call_id`, `content` (string), `is_error` (default false) |
//!
//! Tags and fields are `snake_case` like the rest of the protocol. Blocks written in seed 001's
//! spelling (`tool-call` with `callId`/`input`, `tool-result` with `toolCallId`/`isError`)
//! are accepted on input and written back in the canonical spelling.
//!
//! Messages and blocks are *strict*: unknown fields are rejected (the SDK models use
//! `extra="forbid"`), because they appear in strict result payloads (host-behaviour §13).
//! Vendor-specific encodings (OpenAI `image_url`, Anthropic `thinking`) do not belong here;
//! model providers translate at their edge.
//!
//! ```
//! use sb_protocol::content::{Message, MessageContent};
//! let m: Message = serde_json::from_str(
//!     r#"{"role": "assistant", "content": [{"type": "reasoning", "text": "hmm"},
//!                                          {"type": "text", "text": "hello"}]}"#).unwrap();
//! assert_eq!(m.text(), "hello");
//! let s = Message::assistant("hi");
//! assert_eq!(serde_json::to_string(&s).unwrap(), r#"{"role":"assistant","content":"hi"}"#);
//! ```

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

/// One typed content block. See the module docs for the table of types.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentElement {
    /// Body text of a user or assistant message.
    Text {
        /// The text.
        text: String,
    },
    /// An image given by URL, inline base64 or a stored artifact.
    Image(ImageContent),
    /// Thinking text or summary that the provider allows to show to users. Private
    /// reasoning state (signatures, encrypted items) never goes here.
    Reasoning {
        /// The text.
        text: String,
    },
    /// A tool invocation whose arguments were already validated as a JSON object.
    #[serde(alias = "tool-call")]
    ToolCall {
        /// Call id, unique within the message; `tool_result.tool_call_id` refers to it.
        #[serde(alias = "callId")]
        id: String,
        /// Tool name.
        name: String,
        /// Arguments object.
        #[serde(default, alias = "input")]
        arguments: Map<String, Value>,
    },
    /// The outcome of a tool call, success or failure.
    #[serde(alias = "tool-result")]
    ToolResult {
        /// The `tool_call.id` this answers.
        #[serde(alias = "toolCallId")]
        tool_call_id: String,
        /// The result text given back to the model.
        content: String,
        /// Whether the tool reported a (business) failure.
        #[serde(default, alias = "isError", skip_serializing_if = "is_false")]
        is_error: bool,
    },
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_false(b: &bool) -> bool {
    !*b
}

impl ContentElement {
    /// A `text` block.
    pub fn text(text: impl Into<String>) -> Self {
        Self::Text { text: text.into() }
    }

    /// The text of a `text` block, `None` for any other block.
    #[must_use]
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text { text } => Some(text),
            _ => None,
        }
    }
}

/// The `image` block. At least one source (`url`, `base64`, `artifact_id`) is required.
///
/// ```
/// use sb_protocol::content::ContentElement;
/// assert!(serde_json::from_str::<ContentElement>(r#"{"type": "image", "url": "https://x/y.png"}"#).is_ok());
/// assert!(serde_json::from_str::<ContentElement>(r#"{"type": "image"}"#).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(try_from = "RawImageContent")]
pub struct ImageContent {
    /// An `http(s)` or `data:` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Inline base64 bytes (no `data:` prefix). Large images should be artifacts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base64: Option<String>,
    /// A stored artifact holding the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_id: Option<String>,
    /// MIME type, e.g. `image/png`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
    /// Provider hint for the resolution to use (`low`, `high`, `auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawImageContent {
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    base64: Option<String>,
    #[serde(default)]
    artifact_id: Option<String>,
    #[serde(default)]
    mime_type: Option<String>,
    #[serde(default)]
    detail: Option<String>,
}

impl TryFrom<RawImageContent> for ImageContent {
    type Error = &'static str;

    fn try_from(raw: RawImageContent) -> Result<Self, Self::Error> {
        let present = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.is_empty());
        if !(present(&raw.url) || present(&raw.base64) || present(&raw.artifact_id)) {
            return Err("image block needs one of `url`, `base64` or `artifact_id`");
        }
        Ok(Self {
            url: raw.url,
            base64: raw.base64,
            artifact_id: raw.artifact_id,
            mime_type: raw.mime_type,
            detail: raw.detail,
        })
    }
}

/// A message's `content`: a plain string, or an ordered list of blocks.
///
/// Serialized untagged: a JSON string or a JSON array. Deserialization reports the error of
/// the offending block rather than a generic "did not match any variant".
#[derive(Debug, Clone, PartialEq)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Ordered content blocks.
    Parts(Vec<ContentElement>),
}

impl MessageContent {
    /// The plain text: the string itself, or the `text` blocks concatenated in order
    /// (reasoning, images and tool blocks are skipped).
    #[must_use]
    pub fn text(&self) -> String {
        self.text_joined("")
    }

    /// Like [`text`](Self::text), with `sep` between the `text` blocks.
    #[must_use]
    pub fn text_joined(&self, sep: &str) -> String {
        match self {
            Self::Text(s) => s.clone(),
            Self::Parts(parts) => parts
                .iter()
                .filter_map(ContentElement::as_text)
                .collect::<Vec<_>>()
                .join(sep),
        }
    }

    /// Whether there is nothing at all: an empty string or an empty list.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        match self {
            Self::Text(s) => s.is_empty(),
            Self::Parts(p) => p.is_empty(),
        }
    }
}

impl From<String> for MessageContent {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}

impl From<&str> for MessageContent {
    fn from(s: &str) -> Self {
        Self::Text(s.to_owned())
    }
}

impl From<Vec<ContentElement>> for MessageContent {
    fn from(parts: Vec<ContentElement>) -> Self {
        Self::Parts(parts)
    }
}

impl Serialize for MessageContent {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Text(s) => serializer.serialize_str(s),
            Self::Parts(p) => p.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;

        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = MessageContent;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content blocks")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v.to_owned()))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(part) = seq.next_element::<ContentElement>()? {
                    parts.push(part);
                }
                Ok(MessageContent::Parts(parts))
            }
        }

        deserializer.deserialize_any(ContentVisitor)
    }
}

/// A tool call in OpenAI-compatible form (`tool_calls` of an assistant message), as model
/// providers return it: `{id, type: "function", function: {name, arguments}}` where
/// `arguments` is the raw JSON text the model produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// Call id.
    pub id: String,
    /// Always `function` today.
    #[serde(rename = "type", default = "function_type")]
    pub call_type: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".to_owned()
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as JSON text (possibly invalid JSON: it is model output).
    #[serde(default)]
    pub arguments: String,
}

/// A reference to a stored (or storable) artifact: input attachments, transcript
/// `artifact_refs`, message attachments.
///
/// Not strict: refs are built by the host and by adapters and may carry extra
/// adapter-specific keys, which are kept in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactRef {
    /// Artifact id (caller supplied or host generated).
    pub artifact_id: String,
    /// Kind, e.g. `image`, `file`, `voice`.
    #[serde(default = "file_type")]
    pub artifact_type: String,
    /// MIME type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
    /// File name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Size of the content in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Hex SHA-256 of the content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Where the artifact came from (`url`, `base64`, `platform`, `runner`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// External location, when the content lives outside the artifact store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Small inline content, base64 (optionally a `data:<mime>;base64,` URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_base64: Option<String>,
    /// Free-form metadata.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub metadata: Map<String, Value>,
    /// Other keys, kept as given.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn file_type() -> String {
    "file".to_owned()
}

impl ArtifactRef {
    /// A ref with only an id and a type.
    pub fn new(artifact_id: impl Into<String>, artifact_type: impl Into<String>) -> Self {
        Self {
            artifact_id: artifact_id.into(),
            artifact_type: artifact_type.into(),
            mime_type: None,
            name: None,
            size_bytes: None,
            sha256: None,
            source: None,
            url: None,
            content_base64: None,
            metadata: Map::new(),
            extra: Map::new(),
        }
    }
}

/// Well-known roles. `role` stays a string on the wire.
pub mod role {
    /// System instructions.
    pub const SYSTEM: &str = "system";
    /// End user.
    pub const USER: &str = "user";
    /// The agent.
    pub const ASSISTANT: &str = "assistant";
    /// A tool result message.
    pub const TOOL: &str = "tool";
}

/// A complete message (strict: unknown fields rejected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool` (see [`role`]).
    pub role: String,
    /// The content; absent for e.g. an assistant message that only carries tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// OpenAI-style tool calls of an assistant message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `role: tool`: the call being answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Artifacts attached to this message (merged into the transcript row's refs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifact_refs: Vec<ArtifactRef>,
}

impl Message {
    /// A message with `role` and string content.
    pub fn new(role: impl Into<String>, content: impl Into<MessageContent>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            artifact_refs: Vec::new(),
        }
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<MessageContent>) -> Self {
        Self::new(role::ASSISTANT, content)
    }

    /// A user message.
    pub fn user(content: impl Into<MessageContent>) -> Self {
        Self::new(role::USER, content)
    }

    /// The plain text of the content (see [`MessageContent::text`]); empty if no content.
    #[must_use]
    pub fn text(&self) -> String {
        self.content
            .as_ref()
            .map(MessageContent::text)
            .unwrap_or_default()
    }
}

fn assistant_role() -> String {
    role::ASSISTANT.to_owned()
}

/// One streamed piece of an assistant message (`message.delta`). Same shape as
/// [`Message`] plus streaming hints; `role` defaults to `assistant`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageChunk {
    /// Usually `assistant`.
    #[serde(default = "assistant_role")]
    pub role: String,
    /// The piece of content.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tool calls completed in this piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `role: tool`: the call being answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Runner's own running index of this piece (informational; ordering uses the
    /// transport `sequence`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msg_sequence: Option<u64>,
    /// Set on the last piece of the message, when the runner knows it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub is_final: bool,
}

impl MessageChunk {
    /// An assistant text piece.
    pub fn assistant(content: impl Into<MessageContent>) -> Self {
        Self {
            role: assistant_role(),
            content: Some(content.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            msg_sequence: None,
            is_final: false,
        }
    }

    /// The plain text of the piece; empty if no content.
    #[must_use]
    pub fn text(&self) -> String {
        self.content
            .as_ref()
            .map(MessageContent::text)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn blocks_roundtrip() {
        let v = json!([
            {"type": "reasoning", "text": "thinking"},
            {"type": "text", "text": "I will look up the device."},
            {"type": "image", "url": "https://x/a.png", "mime_type": "image/png"},
            {"type": "image", "artifact_id": "art-1"},
            {"type": "tool_call", "id": "call-7", "name": "device_get", "arguments": {"serial": "1"}},
            {"type": "tool_result", "tool_call_id": "call-7", "content": "ok"},
            {"type": "tool_result", "tool_call_id": "call-8", "content": "boom", "is_error": true},
        ]);
        let c: MessageContent = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&c).unwrap(), v);
        assert_eq!(c.text(), "I will look up the device.");
    }

    #[test]
    fn seed_001_spelling_is_accepted() {
        let b: ContentElement = serde_json::from_value(json!({
            "type": "tool-call", "callId": "call-7", "name": "x", "input": {"a": 1}
        }))
        .unwrap();
        assert_eq!(
            serde_json::to_value(&b).unwrap(),
            json!({"type": "tool_call", "id": "call-7", "name": "x", "arguments": {"a": 1}})
        );
        let b: ContentElement = serde_json::from_value(json!({
            "type": "tool-result", "toolCallId": "call-7", "content": "c", "isError": true
        }))
        .unwrap();
        assert!(matches!(
            b,
            ContentElement::ToolResult { is_error: true, .. }
        ));
    }

    #[test]
    fn blocks_are_strict() {
        for bad in [
            json!({"type": "text", "text": "x", "extra": 1}),
            json!({"type": "text"}),
            json!({"type": "video", "url": "x"}),
            json!({"text": "no type"}),
            json!({"type": "image"}),
            json!({"type": "image", "url": ""}),
            json!({"type": "image", "url": "u", "size": 3}),
            json!({"type": "tool_call", "id": "1", "name": "n", "arguments": "not an object"}),
            json!({"type": "tool_result", "tool_call_id": "1"}),
        ] {
            assert!(
                serde_json::from_value::<ContentElement>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn message_content_errors_name_the_block() {
        let err = serde_json::from_value::<MessageContent>(json!([{"type": "text", "txt": "x"}]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("txt"), "{err}");
        assert!(serde_json::from_value::<MessageContent>(json!(5)).is_err());
        assert!(serde_json::from_value::<MessageContent>(json!({"a": 1})).is_err());
    }

    #[test]
    fn message_strictness_and_defaults() {
        let m: Message =
            serde_json::from_value(json!({"role": "assistant", "content": "hello"})).unwrap();
        assert_eq!(m, Message::assistant("hello"));
        assert!(
            serde_json::from_value::<Message>(
                json!({"role": "assistant", "content": "x", "mood": "happy"})
            )
            .is_err()
        );
        assert!(serde_json::from_value::<Message>(json!({"content": "x"})).is_err());

        let c: MessageChunk = serde_json::from_value(json!({"content": "hel"})).unwrap();
        assert_eq!(c.role, "assistant");
        assert_eq!(c.text(), "hel");
        assert!(
            serde_json::from_value::<MessageChunk>(json!({"content": "x", "delta": true})).is_err()
        );

        let with_tools: Message = serde_json::from_value(json!({
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        }))
        .unwrap();
        assert_eq!(with_tools.text(), "");
        assert_eq!(
            with_tools.tool_calls.as_ref().unwrap()[0].function.name,
            "f"
        );
    }

    #[test]
    fn artifact_ref_keeps_extra_keys() {
        let v = json!({"artifact_id": "a", "artifact_type": "image", "source": "url",
                       "url": "https://x", "platform_ref_id": "p1"});
        let r: ArtifactRef = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(r.extra["platform_ref_id"], "p1");
        assert_eq!(serde_json::to_value(&r).unwrap(), v);
        let r: ArtifactRef = serde_json::from_value(json!({"artifact_id": "b"})).unwrap();
        assert_eq!(r.artifact_type, "file");
    }
}
