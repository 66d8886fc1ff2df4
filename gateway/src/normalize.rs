//! Inbound `POST /v1/events` payload → [`AgentEventEnvelope`]: validation and normalization,
//! as a pure function (no clock, no randomness, no I/O: the caller passes the event id, the
//! time and an id generator), so every rule is unit-tested here.
//!
//! Rules, in the order they are applied:
//!
//! 0. Before this runs, [`ApiJson`](crate::error::ApiJson) has refused a body with a NUL
//!    (U+0000) in any string, `input.text` and `data` included (`400 invalid_argument`):
//!    PostgreSQL cannot store it. Ids refuse every control character (rule 2) anyway.
//! 1. `event_type` and `source` are required: 1–100 characters of `[A-Za-z0-9_.:-]`.
//! 2. Ids (`conversation_id`, `thread_id`, `bot_id`, actor and subject ids) are 1–255
//!    characters without control characters when present (the DB columns are 255 wide).
//! 3. The idempotency key is the `Idempotency-Key` header, else the client `event_id`; both
//!    must be 1–128 characters of `[A-Za-z0-9-_.:]` (SPEC §13). The client `event_id` is
//!    never the primary key (DESIGN-NOTES, Ids); it is kept in `metadata.client_event_id`.
//! 4. Input: a string `text` with no `contents` also becomes one text block; `contents` with
//!    no `text` give `text` = their text blocks joined without separator (host-behaviour §7,
//!    `query_to_event`). `message.received` needs some input (text, a block or an
//!    attachment); other event types may have none. Attachments without an `artifact_id`
//!    get a fresh one.
//! 5. `data` is kept small (host-behaviour §7): keys starting with `_` and
//!    `source_platform_object` are dropped, and so is every value that is not null, a
//!    boolean, a number, or a string of at most `data_string_bytes` UTF-8 bytes (512 by
//!    default; larger payloads belong in an artifact). Dropped keys are listed in
//!    `metadata.dropped_data_keys` so the loss is visible.
//! 6. `delivery` defaults to the API surface, which can stream (SSE).
//! 7. The input summary (event-log column) is the text cut to `input_summary_chars`
//!    characters (997 + `...` for the default 1000).

use sb_protocol::content::{ArtifactRef, ContentElement};
use sb_protocol::context::{
    ActorContext, AgentInput, DeliveryContext, RawEventRef, SubjectContext,
};
use sb_protocol::error::{ErrorCode, HasErrorCode};
use sb_protocol::host::{AgentEventEnvelope, event_types};
use sb_protocol::ids::{EventId, WorkspaceId};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Longest `event_type` / `source` (event-log column width).
pub const MAX_TYPE_LEN: usize = 100;
/// Longest id (conversation, thread, bot, actor, subject; column width).
pub const MAX_ID_LEN: usize = 255;
/// Longest idempotency key (SPEC §13).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 128;
/// Marker appended to a cut summary.
const ELLIPSIS: &str = "...";
/// `data` keys that are never kept (the seed's platform object dump).
const DROPPED_DATA_KEYS: [&str; 1] = ["source_platform_object"];

/// Body of `POST /v1/events`. Unknown fields are refused so that a typo is an error, not a
/// silently ignored field.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IngestRequest {
    /// Stable event type, e.g. `message.received`.
    pub event_type: String,
    /// Where the event comes from (`api`, `platform`, `scheduler`, …).
    pub source: String,
    /// Client-chosen id; used as the idempotency key when no `Idempotency-Key` header is sent.
    #[serde(default)]
    pub event_id: Option<String>,
    /// Epoch seconds; defaults to the time of ingest.
    #[serde(default)]
    pub event_time: Option<i64>,
    /// The platform's own event name.
    #[serde(default)]
    pub source_event_type: Option<String>,
    /// Conversation.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// Thread within the conversation.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// Bot.
    #[serde(default)]
    pub bot_id: Option<String>,
    /// Who caused the event.
    #[serde(default)]
    pub actor: Option<ActorContext>,
    /// What it is about.
    #[serde(default)]
    pub subject: Option<SubjectContext>,
    /// The input; may be absent for non-message events.
    #[serde(default)]
    pub input: Option<IngestInput>,
    /// Small structured payload (see rule 5).
    #[serde(default)]
    pub data: Option<Map<String, Value>>,
    /// Where replies go.
    #[serde(default)]
    pub delivery: Option<DeliveryContext>,
    /// Reference to a raw payload stored elsewhere.
    #[serde(default)]
    pub raw_ref: Option<RawEventRef>,
    /// The agent to handle the event, whatever the scopes say (checked and applied by the
    /// ingest route, `routes::events`, not here: it needs the agent store).
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Deliver later: an RFC 3339 time or epoch seconds (checked and applied by the ingest
    /// route, `routes::events`: the bound needs the clock).
    #[serde(default)]
    pub deliver_at: Option<Value>,
}

/// The `input` of an ingest request: like [`AgentInput`], except that attachments may omit
/// their `artifact_id` (the host assigns one).
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IngestInput {
    /// Plain text.
    #[serde(default)]
    pub text: Option<String>,
    /// Typed content blocks.
    #[serde(default)]
    pub contents: Vec<ContentElement>,
    /// Attachments (artifact refs; `artifact_id` optional).
    #[serde(default)]
    pub attachments: Vec<Map<String, Value>>,
}

/// Limits applied by [`normalize`] (from `limits` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormalizeLimits {
    /// Longest string kept in `data`, in UTF-8 bytes.
    pub data_string_bytes: usize,
    /// Input summary length, in characters.
    pub input_summary_chars: usize,
}

impl Default for NormalizeLimits {
    fn default() -> Self {
        // SPEC §13.
        Self {
            data_string_bytes: 512,
            input_summary_chars: 1000,
        }
    }
}

/// Everything [`normalize`] needs besides the body; the impure parts (id, clock, id
/// generator) come from the caller.
pub struct NormalizeContext<'a> {
    /// Tenant, from the API key.
    pub workspace_id: WorkspaceId,
    /// The host id of the new event.
    pub event_id: EventId,
    /// Now, epoch seconds (default `event_time`).
    pub now: i64,
    /// The `Idempotency-Key` header, if sent.
    pub idempotency_header: Option<&'a str>,
    /// Limits.
    pub limits: NormalizeLimits,
    /// Makes ids for attachments that have none.
    pub new_artifact_id: &'a mut dyn FnMut() -> String,
}

/// The result of a successful normalization.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalized {
    /// The envelope to store.
    pub envelope: AgentEventEnvelope,
    /// The dedupe key (header, else client `event_id`).
    pub idempotency_key: Option<String>,
    /// Input text cut for the event-log summary column.
    pub input_summary: String,
}

/// Why an ingest payload was refused. Always `invalid_argument`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {reason}")]
pub struct NormalizeError {
    /// The offending field (dotted path).
    pub field: String,
    /// What was expected.
    pub reason: String,
}

impl NormalizeError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl HasErrorCode for NormalizeError {
    fn code(&self) -> ErrorCode {
        ErrorCode::InvalidArgument
    }
}

/// Validates and normalizes one ingest request (rules in the module docs).
pub fn normalize(
    req: IngestRequest,
    ctx: NormalizeContext<'_>,
) -> Result<Normalized, NormalizeError> {
    check_type_name("event_type", &req.event_type)?;
    check_type_name("source", &req.source)?;
    if let Some(t) = &req.source_event_type {
        check_text("source_event_type", t, MAX_TYPE_LEN)?;
    }
    for (field, value) in [
        ("conversation_id", &req.conversation_id),
        ("thread_id", &req.thread_id),
        ("bot_id", &req.bot_id),
    ] {
        if let Some(v) = value {
            check_text(field, v, MAX_ID_LEN)?;
        }
    }
    if let Some(actor) = &req.actor {
        check_text("actor.actor_type", &actor.actor_type, MAX_TYPE_LEN)?;
        check_optional("actor.actor_id", actor.actor_id.as_deref())?;
        check_optional("actor.actor_name", actor.actor_name.as_deref())?;
    }
    if let Some(subject) = &req.subject {
        check_text("subject.subject_type", &subject.subject_type, MAX_TYPE_LEN)?;
        check_optional("subject.subject_id", subject.subject_id.as_deref())?;
    }
    if let Some(t) = req.event_time {
        if t < 0 {
            return Err(NormalizeError::new(
                "event_time",
                "must be epoch seconds (>= 0)",
            ));
        }
    }

    // Rule 3: idempotency.
    if let Some(key) = ctx.idempotency_header {
        check_idempotency_key(key)
            .map_err(|reason| NormalizeError::new("Idempotency-Key", reason))?;
    }
    if let Some(key) = &req.event_id {
        check_idempotency_key(key).map_err(|reason| NormalizeError::new("event_id", reason))?;
    }
    let idempotency_key = ctx
        .idempotency_header
        .map(str::to_owned)
        .or_else(|| req.event_id.clone());

    // Rule 4: input.
    let input = normalize_input(req.input.unwrap_or_default(), ctx.new_artifact_id)?;
    let blank = |t: &str| t.trim().is_empty();
    let has_input = input.text.as_deref().is_some_and(|t| !blank(t))
        || input
            .contents
            .iter()
            .any(|c| c.as_text().is_none_or(|t| !blank(t)))
        || !input.attachments.is_empty();
    if req.event_type == event_types::MESSAGE_RECEIVED && !has_input {
        return Err(NormalizeError::new(
            "input",
            "a message.received event needs input text, content blocks or attachments",
        ));
    }

    // Rule 5: data.
    let (data, dropped) = filter_data(req.data.unwrap_or_default(), ctx.limits.data_string_bytes);

    // Rule 6: delivery.
    let delivery = match req.delivery {
        Some(d) => {
            check_text("delivery.surface", &d.surface, MAX_TYPE_LEN)?;
            d
        }
        None => DeliveryContext {
            supports_streaming: true,
            ..DeliveryContext::new("api")
        },
    };

    let mut metadata = Map::new();
    if let Some(key) = &idempotency_key {
        metadata.insert("idempotency_key".into(), Value::String(key.clone()));
    }
    if let Some(client_id) = req.event_id {
        metadata.insert("client_event_id".into(), Value::String(client_id));
    }
    if !dropped.is_empty() {
        metadata.insert(
            "dropped_data_keys".into(),
            dropped.into_iter().map(Value::String).collect(),
        );
    }

    let input_summary = summarize(
        input.text.as_deref().unwrap_or(""),
        ctx.limits.input_summary_chars,
    );
    let envelope = AgentEventEnvelope {
        event_id: ctx.event_id,
        workspace_id: ctx.workspace_id,
        event_type: req.event_type,
        event_time: Some(req.event_time.unwrap_or(ctx.now)),
        source: req.source,
        source_event_type: req.source_event_type,
        bot_id: req.bot_id,
        conversation_id: req.conversation_id,
        thread_id: req.thread_id,
        actor: req.actor,
        subject: req.subject,
        input,
        delivery,
        raw_ref: req.raw_ref,
        data,
        metadata,
    };
    Ok(Normalized {
        envelope,
        idempotency_key,
        input_summary,
    })
}

/// Checks an idempotency key: 1–128 characters of `[A-Za-z0-9-_.:]` (SPEC §13). The error
/// text says what was expected.
pub fn check_idempotency_key(key: &str) -> Result<(), String> {
    let ok = !key.is_empty()
        && key.len() <= MAX_IDEMPOTENCY_KEY_LEN
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "must be 1-{MAX_IDEMPOTENCY_KEY_LEN} characters of [A-Za-z0-9-_.:]"
        ))
    }
}

fn check_type_name(field: &str, value: &str) -> Result<(), NormalizeError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_TYPE_LEN
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
    if ok {
        Ok(())
    } else {
        Err(NormalizeError::new(
            field,
            format!("must be 1-{MAX_TYPE_LEN} characters of [A-Za-z0-9_.:-]"),
        ))
    }
}

fn check_text(field: &str, value: &str, max_chars: usize) -> Result<(), NormalizeError> {
    if value.trim().is_empty() {
        return Err(NormalizeError::new(field, "must not be empty"));
    }
    if value.chars().count() > max_chars {
        return Err(NormalizeError::new(
            field,
            format!("must be at most {max_chars} characters"),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(NormalizeError::new(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

fn check_optional(field: &str, value: Option<&str>) -> Result<(), NormalizeError> {
    value.map_or(Ok(()), |v| check_text(field, v, MAX_ID_LEN))
}

fn normalize_input(
    input: IngestInput,
    new_artifact_id: &mut dyn FnMut() -> String,
) -> Result<AgentInput, NormalizeError> {
    let mut attachments = Vec::with_capacity(input.attachments.len());
    for (index, mut raw) in input.attachments.into_iter().enumerate() {
        let field = format!("input.attachments[{index}]");
        match raw.get("artifact_id") {
            None | Some(Value::Null) => {
                raw.insert("artifact_id".into(), Value::String(new_artifact_id()));
            }
            Some(Value::String(id)) => check_text(&format!("{field}.artifact_id"), id, MAX_ID_LEN)?,
            Some(_) => {
                return Err(NormalizeError::new(
                    format!("{field}.artifact_id"),
                    "must be a string",
                ));
            }
        }
        let attachment: ArtifactRef = serde_json::from_value(Value::Object(raw))
            .map_err(|e| NormalizeError::new(field, format!("not a valid artifact ref: {e}")))?;
        attachments.push(attachment);
    }

    let text_blocks: Vec<&str> = input
        .contents
        .iter()
        .filter_map(ContentElement::as_text)
        .collect();
    let (text, contents) = match input.text {
        Some(text) => {
            let contents = if input.contents.is_empty() && !text.trim().is_empty() {
                vec![ContentElement::text(text.clone())]
            } else {
                input.contents
            };
            (Some(text), contents)
        }
        None if !text_blocks.is_empty() => (Some(text_blocks.concat()), input.contents),
        None => (None, input.contents),
    };
    Ok(AgentInput {
        text,
        contents,
        attachments,
    })
}

/// Keeps the small scalar entries of `data` (rule 5); returns the kept map and the dropped
/// keys (sorted).
fn filter_data(
    data: Map<String, Value>,
    max_string_bytes: usize,
) -> (Map<String, Value>, Vec<String>) {
    let mut kept = Map::new();
    let mut dropped = Vec::new();
    for (key, value) in data {
        let keep = !key.starts_with('_')
            && !DROPPED_DATA_KEYS.contains(&key.as_str())
            && match &value {
                Value::Null | Value::Bool(_) | Value::Number(_) => true,
                Value::String(s) => s.len() <= max_string_bytes,
                Value::Array(_) | Value::Object(_) => false,
            };
        if keep {
            kept.insert(key, value);
        } else {
            dropped.push(key);
        }
    }
    dropped.sort();
    (kept, dropped)
}

/// Cuts `text` to `max_chars` characters, ending a cut text with `...` (host-behaviour §17).
pub fn summarize(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let keep = max_chars.saturating_sub(ELLIPSIS.len());
    let mut out: String = text.chars().take(keep).collect();
    out.push_str(ELLIPSIS);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: Value) -> IngestRequest {
        serde_json::from_value(body).unwrap()
    }

    fn run(body: Value, header: Option<&str>) -> Result<Normalized, NormalizeError> {
        let mut n = 0;
        let mut ids = move || {
            n += 1;
            format!("art-{n}")
        };
        normalize(
            request(body),
            NormalizeContext {
                workspace_id: WorkspaceId::default_workspace(),
                event_id: EventId::new(),
                now: 1_700_000_000,
                idempotency_header: header,
                limits: NormalizeLimits::default(),
                new_artifact_id: &mut ids,
            },
        )
    }

    fn message(extra: Value) -> Value {
        let mut body = json!({
            "event_type": "message.received",
            "source": "api",
            "conversation_id": "c1",
            "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann"},
            "input": {"text": "hello"},
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    #[test]
    fn full_example_normalizes() {
        let n = run(
            json!({
                "event_type": "message.received", "source": "api", "event_id": "client-1",
                "conversation_id": "c1", "thread_id": null, "bot_id": null,
                "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann"},
                "subject": null, "input": {"text": "hello", "contents": [], "attachments": []},
                "data": {}, "delivery": {"surface": "api", "supports_streaming": true}
            }),
            None,
        )
        .unwrap();
        let e = &n.envelope;
        assert_eq!(e.event_type, "message.received");
        assert_eq!(e.workspace_id.as_str(), "default");
        assert_eq!(e.event_time, Some(1_700_000_000));
        assert_eq!(e.input.text.as_deref(), Some("hello"));
        assert_eq!(e.input.contents, vec![ContentElement::text("hello")]);
        assert!(e.delivery.supports_streaming);
        assert_eq!(n.idempotency_key.as_deref(), Some("client-1"));
        assert_eq!(e.metadata["client_event_id"], "client-1");
        assert_eq!(n.input_summary, "hello");
    }

    #[test]
    fn required_names_are_checked() {
        for bad in ["", "has space", "x".repeat(101).as_str(), "a/b"] {
            let err = run(message(json!({"event_type": bad})), None).unwrap_err();
            assert_eq!(err.field, "event_type", "{bad:?}");
            let err = run(message(json!({"source": bad})), None).unwrap_err();
            assert_eq!(err.field, "source", "{bad:?}");
        }
        assert!(run(message(json!({"event_type": "custom.thing-1:v2"})), None).is_ok());
    }

    #[test]
    fn ids_are_checked() {
        let err = run(message(json!({"conversation_id": ""})), None).unwrap_err();
        assert_eq!(err.field, "conversation_id");
        let err = run(message(json!({"bot_id": "x".repeat(256)})), None).unwrap_err();
        assert_eq!(err.field, "bot_id");
        let err = run(message(json!({"thread_id": "a\nb"})), None).unwrap_err();
        assert_eq!(err.field, "thread_id");
        let err = run(message(json!({"actor": {"actor_type": " "}})), None).unwrap_err();
        assert_eq!(err.field, "actor.actor_type");
        let err = run(message(json!({"event_time": -1})), None).unwrap_err();
        assert_eq!(err.field, "event_time");
    }

    #[test]
    fn idempotency_key_rules() {
        assert!(check_idempotency_key("a").is_ok());
        assert!(check_idempotency_key("A-z_0.9:x").is_ok());
        assert!(check_idempotency_key(&"k".repeat(128)).is_ok());
        for bad in ["", "has space", "slash/", "é", &"k".repeat(129)] {
            assert!(check_idempotency_key(bad).is_err(), "{bad:?}");
        }
        let err = run(message(json!({})), Some("bad key")).unwrap_err();
        assert_eq!(err.field, "Idempotency-Key");
        assert_eq!(
            err.to_string(),
            "invalid `Idempotency-Key`: must be 1-128 characters of [A-Za-z0-9-_.:]"
        );
        let err = run(message(json!({"event_id": ""})), None).unwrap_err();
        assert_eq!(err.field, "event_id");
    }

    #[test]
    fn header_wins_over_client_event_id() {
        let n = run(message(json!({"event_id": "client"})), Some("hdr")).unwrap();
        assert_eq!(n.idempotency_key.as_deref(), Some("hdr"));
        assert_eq!(n.envelope.metadata["idempotency_key"], "hdr");
        assert_eq!(n.envelope.metadata["client_event_id"], "client");
        let n = run(message(json!({})), None).unwrap();
        assert_eq!(n.idempotency_key, None);
        assert!(n.envelope.metadata.is_empty());
    }

    #[test]
    fn message_events_need_input_others_do_not() {
        let err = run(message(json!({"input": null})), None).unwrap_err();
        assert_eq!(err.field, "input");
        let err = run(message(json!({"input": {"text": "  "}})), None).unwrap_err();
        assert_eq!(err.field, "input");
        let n = run(
            json!({"event_type": "group.member_joined", "source": "platform"}),
            None,
        )
        .unwrap();
        assert_eq!(n.envelope.input, AgentInput::default());
        assert_eq!(n.input_summary, "");
        assert_eq!(n.envelope.delivery.surface, "api");
    }

    #[test]
    fn contents_give_text_and_text_gives_a_block() {
        let n = run(
            message(json!({"input": {"contents": [
                {"type": "text", "text": "a"},
                {"type": "image", "url": "https://x/y.png"},
                {"type": "text", "text": "b"}
            ]}})),
            None,
        )
        .unwrap();
        assert_eq!(n.envelope.input.text.as_deref(), Some("ab"));
        assert_eq!(n.envelope.input.contents.len(), 3);
    }

    #[test]
    fn attachments_get_ids() {
        let n = run(
            message(json!({"input": {"text": "see", "attachments": [
                {"artifact_type": "image", "url": "https://x/y.png"},
                {"artifact_id": "mine", "name": "f.txt"}
            ]}})),
            None,
        )
        .unwrap();
        let a = &n.envelope.input.attachments;
        assert_eq!(a[0].artifact_id, "art-1");
        assert_eq!(a[0].artifact_type, "image");
        assert_eq!(a[1].artifact_id, "mine");
        assert_eq!(a[1].artifact_type, "file");
        let err = run(
            message(json!({"input": {"text": "x", "attachments": [{"artifact_id": 5}]}})),
            None,
        )
        .unwrap_err();
        assert_eq!(err.field, "input.attachments[0].artifact_id");
    }

    #[test]
    fn data_keeps_small_scalars_only() {
        let long = "é".repeat(257); // 514 bytes
        let n = run(
            message(json!({"data": {
                "n": 1, "f": 1.5, "b": true, "z": null, "s": "x".repeat(512),
                "long": long, "list": [1], "obj": {"a": 1}, "_private": 1,
                "source_platform_object": "x"
            }})),
            None,
        )
        .unwrap();
        let data = &n.envelope.data;
        let mut kept: Vec<&str> = data.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["b", "f", "n", "s", "z"]);
        assert_eq!(
            n.envelope.metadata["dropped_data_keys"],
            json!(["_private", "list", "long", "obj", "source_platform_object"])
        );
    }

    #[test]
    fn summary_is_cut_with_ellipsis() {
        assert_eq!(summarize("short", 1000), "short");
        let text = "é".repeat(1001);
        let s = summarize(&text, 1000);
        assert_eq!(s.chars().count(), 1000);
        assert!(s.ends_with("..."));
        assert_eq!(summarize(&"a".repeat(1000), 1000).len(), 1000);
        let n = run(message(json!({"input": {"text": "x".repeat(2000)}})), None).unwrap();
        assert_eq!(n.input_summary.chars().count(), 1000);
        assert_eq!(n.envelope.input.text.as_deref().map(str::len), Some(2000));
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_value::<IngestRequest>(message(json!({"evnet_type": "x"})))
            .unwrap_err();
        assert!(err.to_string().contains("evnet_type"), "{err}");
    }
}
