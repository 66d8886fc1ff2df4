//! OpenAI-compatible chat completions (`POST {base_url}/chat/completions`, plain and SSE
//! stream) and Cohere/Jina-style rerank (`POST {base_url}/rerank`).
//!
//! Messages go to the provider as the runner sent them (OpenAI chat message objects);
//! `funcs` become `tools` (`{type: "function", function}`); the request body is the
//! model's registered `extra_args`, overridden by the call's, with `model`, `messages`,
//! `tools` and `stream` always ours. The answer message is normalized to
//! `{role: "assistant", content, tool_calls?}` for plain and streamed calls alike.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use sb_common::sse::{SseEvent, SseParser};
use sb_store::ModelRecord;
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::{
    ProviderClient, ProviderError, ProviderOptions, attempt_limit, read_capped, send_with_retries,
};

const WHAT: &str = "model provider";

/// One chat call.
#[derive(Debug, Clone, Copy)]
pub struct ChatRequest<'a> {
    /// The registered model.
    pub model: &'a ModelRecord,
    /// Chat messages.
    pub messages: &'a [Value],
    /// Function definitions (`{name, description, parameters}` or already OpenAI tools).
    pub funcs: &'a [Value],
    /// The call's extra body fields.
    pub extra_args: Option<&'a Map<String, Value>>,
}

/// A completed chat call.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatAnswer {
    /// `{role: "assistant", content, tool_calls?}`.
    pub message: Value,
    /// The provider's usage object (`{}` when it sent none).
    pub usage: Value,
}

/// Characters of model output in a normalized message: content plus tool call names and
/// arguments (what the output budget counts).
#[must_use]
pub fn output_chars(message: &Value) -> u64 {
    let mut n = message
        .get("content")
        .and_then(Value::as_str)
        .map_or(0, |s| s.chars().count());
    for call in message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for k in ["name", "arguments"] {
            n += call["function"][k]
                .as_str()
                .map_or(0, |s| s.chars().count());
        }
    }
    n as u64
}

fn endpoint(model: &ModelRecord, path: &str) -> String {
    format!("{}/{path}", model.base_url.trim_end_matches('/'))
}

fn body(req: &ChatRequest<'_>, stream: bool) -> Value {
    let mut body = Map::new();
    if let Value::Object(extra) = &req.model.extra_args {
        body.extend(extra.clone());
    }
    if let Some(extra) = req.extra_args {
        body.extend(extra.clone());
    }
    body.insert("model".into(), json!(req.model.model_name));
    body.insert("messages".into(), Value::Array(req.messages.to_vec()));
    if req.funcs.is_empty() {
        body.remove("tools");
    } else {
        let tools = req
            .funcs
            .iter()
            .map(|f| {
                if f.get("type").is_some() && f.get("function").is_some() {
                    f.clone()
                } else {
                    json!({"type": "function", "function": f})
                }
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    body.insert("stream".into(), json!(stream));
    if stream {
        body.insert("stream_options".into(), json!({"include_usage": true}));
    } else {
        body.remove("stream_options");
    }
    Value::Object(body)
}

/// The request of one attempt. With `timeout`, each attempt gets that whole-request
/// timeout, cut to what is left before `deadline` when the attempt starts.
fn request(
    client: &ProviderClient,
    model: &ModelRecord,
    path: &str,
    body: &Value,
    timeout: Option<Duration>,
    deadline: Option<Instant>,
) -> Result<impl Fn() -> reqwest::RequestBuilder, ProviderError> {
    let url = endpoint(model, path);
    // Checked once here, so the closure below cannot fail.
    client.check(WHAT, &url)?;
    let key = model
        .api_key_env
        .as_deref()
        .map(|name| client.secret(name))
        .transpose()?;
    let client = client.clone();
    let body = body.clone();
    Ok(move || {
        let mut rb = client.post_checked(&url).json(&body);
        if let Some(t) = timeout {
            rb = rb.timeout(attempt_limit(t, deadline));
        }
        if let Some(key) = &key {
            rb = rb.bearer_auth(key);
        }
        rb
    })
}

/// Normalizes a provider's `choices[0].message`.
fn normalize_message(m: &Value) -> Value {
    let mut out =
        json!({"role": "assistant", "content": m.get("content").cloned().unwrap_or(Value::Null)});
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array)
        && !calls.is_empty()
    {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": c["function"].get("name").cloned().unwrap_or(Value::Null),
                        "arguments": c["function"].get("arguments").cloned().unwrap_or(json!("")),
                    }
                })
            })
            .collect();
        out["tool_calls"] = Value::Array(calls);
    }
    out
}

/// A plain (non-streaming) chat call: each attempt bounded by
/// [`ProviderOptions::model_timeout`], all of them by the run's `deadline`.
pub async fn chat(
    client: &ProviderClient,
    options: &ProviderOptions,
    req: ChatRequest<'_>,
    deadline: Option<Instant>,
) -> Result<ChatAnswer, ProviderError> {
    let body = body(&req, false);
    let build = request(
        client,
        req.model,
        "chat/completions",
        &body,
        Some(options.model_timeout),
        deadline,
    )?;
    let resp = send_with_retries(options, WHAT, deadline, build).await?;
    let bytes = read_capped(resp, WHAT, options.max_model_response_bytes).await?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|_| ProviderError::Malformed("model provider sent invalid json".into()))?;
    let message = v["choices"][0]
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| ProviderError::Malformed("model provider sent no message".into()))?;
    Ok(ChatAnswer {
        message: normalize_message(message),
        usage: v
            .get("usage")
            .filter(|u| u.is_object())
            .cloned()
            .unwrap_or(json!({})),
    })
}

/// One event of a chat stream.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// A delta: `{role: "assistant", content?, tool_calls?}`, as the provider sent it.
    Chunk(Value),
}

#[derive(Debug, Default)]
struct ToolCallAcc {
    id: Option<String>,
    name: String,
    arguments: String,
}

/// An open chat stream. [`ChatStream::next`] yields deltas until the provider's `[DONE]`;
/// [`ChatStream::finish`] then gives the assembled message and usage.
///
/// The body is read as a server-sent event stream by the book ([`sb_common::sse`]): an event
/// is whatever lies between blank lines, its `data` lines joined (a provider may spread one
/// JSON chunk over several), with LF, CRLF or CR line ends, comments and `id`/`retry` lines
/// understood, so no provider's framing is mistaken for content.
#[derive(Debug)]
pub struct ChatStream {
    resp: reqwest::Response,
    idle: Duration,
    events: SseParser,
    ready: VecDeque<SseEvent>,
    done: bool,
    content: String,
    saw_content: bool,
    tool_calls: BTreeMap<u64, ToolCallAcc>,
    usage: Value,
}

/// Opens a streaming chat call (retrying the opening request per the options). Each
/// attempt must get the response headers within [`ProviderOptions::model_timeout`] and
/// before the run's `deadline`, or the call fails with [`ProviderError::Timeout`]; the
/// stream itself is then bounded by [`ProviderOptions::stream_idle_timeout`] per chunk
/// and by the caller's deadline.
pub async fn chat_stream(
    client: &ProviderClient,
    options: &ProviderOptions,
    req: ChatRequest<'_>,
    deadline: Option<Instant>,
) -> Result<ChatStream, ProviderError> {
    let body = body(&req, true);
    // No whole-request timeout: a stream lives as long as it makes progress. Its opening
    // is bounded by `send_with_retries`.
    let build = request(client, req.model, "chat/completions", &body, None, deadline)?;
    let resp = send_with_retries(options, WHAT, deadline, build).await?;
    Ok(ChatStream {
        resp,
        idle: options.stream_idle_timeout,
        events: SseParser::default(),
        ready: VecDeque::new(),
        done: false,
        content: String::new(),
        saw_content: false,
        tool_calls: BTreeMap::new(),
        usage: json!({}),
    })
}

fn malformed() -> ProviderError {
    ProviderError::Malformed("model provider sent a malformed stream event".into())
}

impl ChatStream {
    /// The next delta; `None` after `[DONE]`. A stream that ends without `[DONE]`, an event
    /// whose data is not JSON, an event larger than [`sb_common::sse::DEFAULT_MAX_EVENT_BYTES`],
    /// or an error event (`event: error`, or data with an `error` member) is an error.
    pub async fn next(&mut self) -> Result<Option<StreamEvent>, ProviderError> {
        loop {
            if self.done {
                return Ok(None);
            }
            if let Some(event) = self.ready.pop_front() {
                let data = event.data.trim();
                if data == "[DONE]" {
                    self.done = true;
                    return Ok(None);
                }
                if data.is_empty() && event.event != "error" {
                    // An empty `data:` event carries nothing (some servers use it to keep
                    // the connection alive).
                    continue;
                }
                if event.event == "error" {
                    return Err(ProviderError::Malformed(
                        "model provider reported an error in the stream".into(),
                    ));
                }
                let v: Value = serde_json::from_str(data).map_err(|_| malformed())?;
                if v.get("error").is_some_and(|e| !e.is_null()) {
                    return Err(ProviderError::Malformed(
                        "model provider reported an error in the stream".into(),
                    ));
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    self.usage = u.clone();
                }
                if let Some(chunk) = self.absorb(&v) {
                    return Ok(Some(StreamEvent::Chunk(chunk)));
                }
                continue;
            }
            match tokio::time::timeout(self.idle, self.resp.chunk()).await {
                Err(_) => return Err(ProviderError::Timeout(WHAT.into())),
                Ok(Err(e)) => return Err(ProviderError::from_reqwest(WHAT, &e)),
                Ok(Ok(Some(bytes))) => {
                    let mut parsed = Vec::new();
                    let pushed = self.events.push(&bytes, &mut parsed);
                    self.ready.extend(parsed);
                    if let Err(e) = pushed {
                        return Err(ProviderError::Malformed(format!(
                            "model provider stream is unreadable: {e}"
                        )));
                    }
                }
                Ok(Ok(None)) => {
                    return Err(ProviderError::Malformed(
                        "model provider stream ended before [DONE]".into(),
                    ));
                }
            }
        }
    }

    /// Folds one event's delta into the assembled message; the runner-facing chunk, if
    /// the delta carried anything.
    fn absorb(&mut self, v: &Value) -> Option<Value> {
        let delta = v["choices"][0].get("delta")?;
        let mut chunk = json!({"role": "assistant"});
        let mut any = false;
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            self.saw_content = true;
            self.content.push_str(text);
            chunk["content"] = json!(text);
            any = true;
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array)
            && !calls.is_empty()
        {
            for (pos, c) in calls.iter().enumerate() {
                let index = c.get("index").and_then(Value::as_u64).unwrap_or(pos as u64);
                let acc = self.tool_calls.entry(index).or_default();
                if let Some(id) = c.get("id").and_then(Value::as_str) {
                    acc.id = Some(id.to_owned());
                }
                if let Some(n) = c["function"].get("name").and_then(Value::as_str) {
                    acc.name.push_str(n);
                }
                if let Some(a) = c["function"].get("arguments").and_then(Value::as_str) {
                    acc.arguments.push_str(a);
                }
            }
            chunk["tool_calls"] = Value::Array(calls.clone());
            any = true;
        }
        any.then_some(chunk)
    }

    /// The assembled message and the usage (after `next` answered `None`).
    #[must_use]
    pub fn finish(self) -> ChatAnswer {
        let mut message = json!({
            "role": "assistant",
            "content": if self.saw_content { json!(self.content) } else { Value::Null },
        });
        if !self.tool_calls.is_empty() {
            message["tool_calls"] = self
                .tool_calls
                .into_values()
                .map(|c| {
                    json!({
                        "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}
                    })
                })
                .collect();
        }
        ChatAnswer {
            message,
            usage: self.usage,
        }
    }
}

/// One rerank call: `{index, relevance_score, document}` sorted by score, best first, cut
/// to `top_k`. Bounded as [`chat`] is.
pub async fn rerank(
    client: &ProviderClient,
    options: &ProviderOptions,
    model: &ModelRecord,
    query: &str,
    documents: &[Value],
    top_k: Option<usize>,
    deadline: Option<Instant>,
) -> Result<Vec<Value>, ProviderError> {
    let mut body = Map::new();
    if let Value::Object(extra) = &model.extra_args {
        body.extend(extra.clone());
    }
    body.insert("model".into(), json!(model.model_name));
    body.insert("query".into(), json!(query));
    body.insert("documents".into(), Value::Array(documents.to_vec()));
    if let Some(k) = top_k {
        body.insert("top_n".into(), json!(k));
    }
    let body = Value::Object(body);
    let build = request(
        client,
        model,
        "rerank",
        &body,
        Some(options.model_timeout),
        deadline,
    )?;
    let resp = send_with_retries(options, WHAT, deadline, build).await?;
    let bytes = read_capped(resp, WHAT, options.max_model_response_bytes).await?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|_| ProviderError::Malformed("rerank provider sent invalid json".into()))?;
    let results = v
        .get("results")
        .and_then(Value::as_array)
        .ok_or_else(|| ProviderError::Malformed("rerank provider sent no results".into()))?;
    let mut out = Vec::with_capacity(results.len());
    for r in results {
        let index = r
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok());
        let score = r.get("relevance_score").and_then(Value::as_f64);
        let (Some(index), Some(score)) = (index, score) else {
            return Err(ProviderError::Malformed(
                "rerank provider sent a malformed result".into(),
            ));
        };
        let Some(doc) = documents.get(index) else {
            return Err(ProviderError::Malformed(
                "rerank provider sent an unknown index".into(),
            ));
        };
        out.push((index, score, doc.clone()));
    }
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if let Some(k) = top_k {
        out.truncate(k);
    }
    Ok(out
        .into_iter()
        .map(|(index, score, document)| {
            json!({"index": index, "relevance_score": score, "document": document})
        })
        .collect())
}
