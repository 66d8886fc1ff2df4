//! Model, tool, knowledge, prompt and config-file actions.
//!
//! The grant check is step 4 (the resource id and operation must be in the frozen
//! snapshot, with the seed's wording): a run holding no grant of the kind for the operation
//! is refused whatever its arguments; otherwise the id must be given and granted. Then the
//! arguments, admission (size, rate), the registry lookup (a granted id whose resource was
//! deleted since is `not_found`), the budgets (see `budgets`), and the provider call.
//!
//! Models, tools and knowledge bases are served from the workspace registry
//! (`sb_store::ResourceRegistry`) through the clients of [`crate::providers`]. There are no
//! pipeline prompts and no config files yet: those granted calls answer `not_found`.
//! Every model and tool call is logged with run, duration, usage and outcome.

use std::time::{Duration, Instant};

use sb_protocol::error::{AgentApiError, ErrorCode};
use sb_protocol::manifest::{FileOp, KnowledgeBaseOp, ModelOp, ToolOp};
use sb_store::{KbSearch, ModelKind, ModelRecord, ToolRecord};
use serde_json::{Value, json};
use uuid::Uuid;

use super::budgets::{self, Budget, Claim};
use super::params::Params;
use super::{
    Action, ActionDispatcher, Cx, answer, api_not_granted, invalid, not_found, store_error,
    unauthorized,
};
use crate::providers::http_tool::HttpToolConfig;
use crate::providers::{ProviderError, openai};

/// `top_k` of `retrieve_knowledge` without one.
pub const DEFAULT_KB_TOP_K: i64 = 5;
/// How long past its timeout an idempotent tool call may still be running elsewhere before
/// its outcome is declared lost.
const TOOL_CLAIM_GRACE: Duration = Duration::from_secs(5);

/// Step 4 for one resource: `any` says whether the run holds a grant of this kind for `op`
/// at all, `allows` whether it holds it for a given id.
fn granted_id<'a>(
    p: &Params<'a>,
    names: &[&str],
    (kind, op): (&str, &str),
    any: bool,
    allows: impl Fn(&str) -> bool,
) -> Result<&'a str, AgentApiError> {
    if !any {
        return Err(unauthorized(format!(
            "no {kind} is authorized for operation {op} for this agent run"
        )));
    }
    let id = p.req_str_any(names)?;
    if !allows(id) {
        // The seed's wording.
        return Err(unauthorized(format!(
            "{kind} {id} is not authorized for operation {op} for this agent run"
        )));
    }
    Ok(id)
}

impl ActionDispatcher {
    pub(super) async fn unprovided(
        &self,
        action: Action,
        cx: &Cx<'_, '_>,
    ) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let res = &snap.resources;
        let p = cx.p;
        let missing = match action {
            Action::GetConfigFile => {
                let op = FileOp::Config;
                let any = res.files.iter().any(|f| f.operations.contains(&op));
                let file = granted_id(p, &["file_key"], ("file", op.as_str()), any, |id| {
                    snap.allows_file(id, op)
                })?;
                format!("config file {file} not found")
            }
            _ => {
                if !snap.available_apis.prompt_get {
                    return Err(api_not_granted("get prompt"));
                }
                format!("prompt for run {} not found", cx.call.run_id)
            }
        };
        self.admit(cx).await?;
        Err(not_found(missing).with_detail("reason", "this host has no provider for this resource"))
    }

    /// Step 4 for a model, then the registered model (`not_found` in the seed's wording
    /// when the id names nothing, or a model of the other kind).
    async fn granted_model(
        &self,
        cx: &Cx<'_, '_>,
        op: ModelOp,
    ) -> Result<(&'static str, String), AgentApiError> {
        let snap = cx.call.snapshot;
        let names: &[&str] = if op == ModelOp::Rerank {
            &["rerank_model_uuid", "rerank_model_id", "model_id"]
        } else {
            &["llm_model_uuid", "model_id"]
        };
        let any = snap
            .resources
            .models
            .iter()
            .any(|m| m.operations.contains(&op));
        let id = granted_id(cx.p, names, ("model", op.as_str()), any, |id| {
            snap.allows_model(id, op)
        })?;
        Ok((names[0], id.to_owned()))
    }

    async fn load_model(
        &self,
        cx: &Cx<'_, '_>,
        id: &str,
        kind: ModelKind,
    ) -> Result<ModelRecord, AgentApiError> {
        let missing = || {
            not_found(match kind {
                ModelKind::Llm => format!("llm model with llm_model_uuid {id} not found"),
                ModelKind::Rerank => format!("rerank model with uuid {id} not found"),
            })
        };
        let Ok(uuid) = id.parse::<Uuid>() else {
            return Err(missing());
        };
        match self
            .stores
            .resources
            .get_model(&cx.call.snapshot.workspace_id, uuid)
            .await
        {
            Ok(m) if m.kind == kind && m.enabled => Ok(m),
            Ok(_) | Err(sb_store::StoreError::NotFound(_)) => Err(missing()),
            Err(e) => Err(store_error(&e)),
        }
    }

    /// The run's deadline as an instant, taken once per call: every wait of a model call
    /// (an attempt, a retry backoff, the stream) ends by it.
    fn run_deadline(cx: &Cx<'_, '_>) -> Option<tokio::time::Instant> {
        budgets::until_deadline(cx.call.snapshot).map(|left| tokio::time::Instant::now() + left)
    }

    /// `invoke_llm` / `invoke_llm_stream`.
    pub(super) async fn invoke_llm(
        &self,
        cx: &Cx<'_, '_>,
        stream: bool,
    ) -> Result<Value, AgentApiError> {
        let op = if stream {
            ModelOp::Stream
        } else {
            ModelOp::Invoke
        };
        let (_, id) = self.granted_model(cx, op).await?;
        let p = cx.p;
        let messages = match p.get("messages") {
            Some(Value::Array(m)) => m,
            Some(_) => return Err(invalid("messages must be a list")),
            None => return Err(invalid("messages is required")),
        };
        for m in messages {
            if !m.get("role").is_some_and(Value::is_string) {
                return Err(invalid("every message must be an object with a role"));
            }
        }
        let funcs: &[Value] = match p.get("funcs") {
            None => &[],
            Some(Value::Array(f)) => f,
            Some(_) => return Err(invalid("funcs must be a list")),
        };
        let extra_args = p.opt_object("extra_args")?;
        self.admit(cx).await?;
        let model = self.load_model(cx, &id, ModelKind::Llm).await?;
        let snap = cx.call.snapshot;
        budgets::ensure_left(self.sessions.as_ref(), snap, Budget::ModelOutputChars).await?;
        budgets::charge(self.sessions.as_ref(), snap, Budget::ModelCalls, 1).await?;
        let req = openai::ChatRequest {
            model: &model,
            messages,
            funcs,
            extra_args,
        };
        let started = Instant::now();
        // The usage is logged even when the answer is then refused (output budget): the
        // provider has done, and billed, the work.
        let (outcome, usage) = if stream {
            let outcome = self.stream_llm(cx, req).await;
            let usage = outcome.as_ref().ok().and_then(|v| v.get("usage").cloned());
            (outcome, usage)
        } else {
            match openai::chat(
                &self.providers.client,
                &self.providers.options,
                req,
                Self::run_deadline(cx),
            )
            .await
            {
                Ok(a) => {
                    let chars = openai::output_chars(&a.message);
                    let charged = budgets::charge(
                        self.sessions.as_ref(),
                        snap,
                        Budget::ModelOutputChars,
                        chars,
                    )
                    .await;
                    let usage = a.usage.clone();
                    (
                        charged.map(|()| json!({"message": a.message, "usage": a.usage})),
                        Some(usage),
                    )
                }
                Err(e) => (Err(provider_error(&e)), None),
            }
        };
        log_model_call(cx, &model, stream, started, usage.as_ref(), &outcome);
        outcome
    }

    async fn stream_llm(
        &self,
        cx: &Cx<'_, '_>,
        req: openai::ChatRequest<'_>,
    ) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        // One deadline for the opening and the whole stream.
        let deadline = Self::run_deadline(cx);
        let mut s = openai::chat_stream(
            &self.providers.client,
            &self.providers.options,
            req,
            deadline,
        )
        .await
        .map_err(|e| provider_error(&e))?;
        loop {
            let next = match deadline {
                Some(at) => tokio::time::timeout_at(at, s.next())
                    .await
                    .unwrap_or_else(|_| Err(ProviderError::Timeout("model provider".into()))),
                None => s.next().await,
            };
            match next.map_err(|e| provider_error(&e))? {
                Some(openai::StreamEvent::Chunk(chunk)) => {
                    let chars = openai::output_chars(&chunk);
                    budgets::charge(
                        self.sessions.as_ref(),
                        snap,
                        Budget::ModelOutputChars,
                        chars,
                    )
                    .await?;
                    if let Some(stream) = cx.stream
                        && !stream.send(json!({"chunk": chunk})).await
                    {
                        return Err(AgentApiError::new(
                            ErrorCode::Cancelled,
                            "the runner is gone",
                        ));
                    }
                }
                None => break,
            }
        }
        let a = s.finish();
        Ok(json!({"message": a.message, "usage": a.usage}))
    }

    /// `invoke_rerank`.
    pub(super) async fn invoke_rerank(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let (_, id) = self.granted_model(cx, ModelOp::Rerank).await?;
        let p = cx.p;
        let query = p.req_str("query")?;
        let documents = match p.get("documents") {
            Some(Value::Array(d)) => d,
            _ => return Err(invalid("documents must be a list")),
        };
        let max = self.limits.rerank_documents_max;
        if documents.len() > max {
            return Err(invalid(format!(
                "at most {max} documents can be reranked in one call"
            ))
            .with_detail("limit", max)
            .with_detail("size", documents.len()));
        }
        let top_k = match p.opt_i64("top_k")? {
            None => None,
            Some(k) if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            Some(_) => return Err(invalid("top_k must be at least 1")),
        };
        self.admit(cx).await?;
        let model = self.load_model(cx, &id, ModelKind::Rerank).await?;
        if documents.is_empty() {
            return Ok(json!({"results": []}));
        }
        budgets::charge(
            self.sessions.as_ref(),
            cx.call.snapshot,
            Budget::ModelCalls,
            1,
        )
        .await?;
        let started = Instant::now();
        let outcome = openai::rerank(
            &self.providers.client,
            &self.providers.options,
            &model,
            query,
            documents,
            top_k,
            Self::run_deadline(cx),
        )
        .await
        .map(|results| json!({"results": results}))
        .map_err(|e| provider_error(&e));
        // The rerank client surfaces only the ranked results, not the provider's usage.
        log_model_call(cx, &model, false, started, None, &outcome);
        outcome
    }

    fn granted_tool<'p>(&self, cx: &Cx<'_, 'p>, op: ToolOp) -> Result<&'p str, AgentApiError> {
        let snap = cx.call.snapshot;
        let any = snap
            .resources
            .tools
            .iter()
            .any(|t| t.operations.contains(&op));
        granted_id(cx.p, &["tool_name"], ("tool", op.as_str()), any, |id| {
            snap.allows_tool(id, op)
        })
    }

    async fn load_tool(&self, cx: &Cx<'_, '_>, name: &str) -> Result<ToolRecord, AgentApiError> {
        match self
            .stores
            .resources
            .get_tool(&cx.call.snapshot.workspace_id, name)
            .await
        {
            Ok(t) if t.enabled => Ok(t),
            Ok(_) | Err(sb_store::StoreError::NotFound(_)) => {
                Err(not_found(format!("tool {name} not found")))
            }
            Err(e) => Err(store_error(&e)),
        }
    }

    /// `get_tool_detail`.
    pub(super) async fn get_tool_detail(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let name = self.granted_tool(cx, ToolOp::Detail)?;
        self.admit(cx).await?;
        let t = self.load_tool(cx, name).await?;
        Ok(json!({"tool": {
            "name": t.name,
            "label": t.name,
            "description": t.description,
            "human_desc": t.description,
            "parameters": t.parameters,
            "spec": {"kind": t.kind},
        }}))
    }

    /// `call_tool`.
    pub(super) async fn call_tool(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let name = self.granted_tool(cx, ToolOp::Call)?;
        let p = cx.p;
        if !p.has_key("parameters") {
            return Err(invalid(
                "parameters is required for agent runner tool calls",
            ));
        }
        let parameters = match p.get("parameters") {
            None => json!({}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => return Err(invalid("parameters must be an object")),
        };
        let call_id = p.opt_str("call_id")?.filter(|s| !s.is_empty());
        if call_id.is_some_and(|c| c.chars().count() > 255) {
            return Err(invalid("call_id is longer than 255 characters"));
        }
        self.admit(cx).await?;
        let tool = self.load_tool(cx, name).await?;
        let config = HttpToolConfig::of(&tool)
            .map_err(|e| provider_error(&e))?
            .within(
                self.limits.tool_timeout_max,
                self.limits.tool_response_bytes_max,
            );
        let snap = cx.call.snapshot;
        let Some(call_id) = call_id else {
            budgets::charge(self.sessions.as_ref(), snap, Budget::ToolCalls, 1).await?;
            return self.execute_tool(cx, &tool, &config, &parameters).await;
        };
        let max_running = config.timeout() + TOOL_CLAIM_GRACE;
        match budgets::claim(
            self.sessions.as_ref(),
            snap.run_id,
            budgets::run_ttl(snap),
            name,
            call_id,
            &parameters,
            max_running,
        )
        .await?
        {
            Claim::Answer(outcome) => {
                tracing::info!(run_id = %snap.run_id, tool = name, call_id, ok = outcome.is_ok(), "tool call replayed");
                outcome
            }
            Claim::Execute(claimed) => {
                // Refused before execution: nothing to remember, the id may be used again.
                if let Err(e) =
                    budgets::charge(self.sessions.as_ref(), snap, Budget::ToolCalls, 1).await
                {
                    claimed.release(self.sessions.as_ref()).await;
                    return Err(e);
                }
                let outcome = self.execute_tool(cx, &tool, &config, &parameters).await;
                claimed.finish(self.sessions.as_ref(), &outcome).await;
                outcome
            }
        }
    }

    /// Runs the tool once (its call already charged) with `config`, its configuration
    /// within the deployment's ceilings, and checks the result budget.
    async fn execute_tool(
        &self,
        cx: &Cx<'_, '_>,
        tool: &ToolRecord,
        config: &HttpToolConfig,
        parameters: &Value,
    ) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let started = Instant::now();
        // Characters of the tool's answer (its "usage"), when it answered.
        let mut result_chars: Option<u64> = None;
        let outcome = match crate::providers::http_tool::call(
            &self.providers.client,
            &tool.name,
            config,
            parameters,
            budgets::until_deadline(snap),
        )
        .await
        {
            Ok(result) => {
                let chars = match &result {
                    Value::String(s) => s.chars().count(),
                    other => other.to_string().chars().count(),
                } as u64;
                result_chars = Some(chars);
                let limit = snap.budgets.max_tool_result_chars;
                if chars > limit {
                    Err(budgets::exceeded(
                        "tool_result_chars",
                        i64::try_from(limit).unwrap_or(i64::MAX),
                    )
                    .with_detail("size", chars))
                } else {
                    answer(&json!({"result": result}))
                }
            }
            Err(e) => Err(provider_error(&e).with_detail("tool_name", tool.name.as_str())),
        };
        let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        match &outcome {
            Ok(_) => tracing::info!(
                run_id = %snap.run_id, tool = %tool.name, duration_ms = ms, outcome = "ok",
                result_chars, "tool called"
            ),
            Err(e) => tracing::info!(
                run_id = %snap.run_id, tool = %tool.name, duration_ms = ms, outcome = %e.code,
                message = %e.message, result_chars, "tool call failed"
            ),
        }
        outcome
    }

    /// `retrieve_knowledge`.
    pub(super) async fn retrieve_knowledge(&self, cx: &Cx<'_, '_>) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let op = KnowledgeBaseOp::Retrieve;
        let any = snap
            .resources
            .knowledge_bases
            .iter()
            .any(|k| k.operations.contains(&op));
        let p = cx.p;
        let kb = granted_id(p, &["kb_id"], ("knowledge_base", op.as_str()), any, |id| {
            snap.allows_knowledge_base(id, op)
        })?;
        let query = p.req_str("query_text")?;
        let top_k = p.opt_i64("top_k")?.unwrap_or(DEFAULT_KB_TOP_K);
        if !(1..=i64::try_from(sb_store::resources::MAX_KB_TOP_K).unwrap_or(50)).contains(&top_k) {
            return Err(invalid(format!(
                "top_k must be between 1 and {}",
                sb_store::resources::MAX_KB_TOP_K
            )));
        }
        let mut document_ids = Vec::new();
        if let Some(filters) = p.opt_object("filters")? {
            for (k, v) in filters {
                let ids: Vec<&Value> = match (k.as_str(), v) {
                    ("document_id", v @ Value::String(_)) => vec![v],
                    ("document_ids", Value::Array(a)) => a.iter().collect(),
                    _ => {
                        return Err(invalid(format!(
                            "unsupported filter {k}: filters may hold document_id or document_ids"
                        )));
                    }
                };
                for id in ids {
                    let parsed = id.as_str().and_then(|s| s.parse::<Uuid>().ok());
                    let Some(parsed) = parsed else {
                        return Err(invalid("document ids must be uuid strings"));
                    };
                    document_ids.push(parsed);
                }
            }
        }
        self.admit(cx).await?;
        let missing = || not_found(format!("knowledge base {kb} not found"));
        let Ok(kb_id) = kb.parse::<Uuid>() else {
            return Err(missing());
        };
        let hits = self
            .stores
            .resources
            .search_kb(KbSearch {
                workspace_id: snap.workspace_id.clone(),
                kb_id,
                query: query.to_owned(),
                top_k: u64::try_from(top_k).unwrap_or(5),
                document_ids,
            })
            .await
            .map_err(|e| match e {
                sb_store::StoreError::NotFound(_) => missing(),
                e => store_error(&e),
            })?;
        let results: Vec<Value> = hits
            .into_iter()
            .map(|h| {
                json!({
                    "content": h.content,
                    "score": h.score,
                    "document_id": h.document_id,
                    "title": h.title,
                    "chunk_index": h.chunk_index,
                })
            })
            .collect();
        Ok(json!({"results": results}))
    }
}

/// The one conversion of provider failures into runner-visible errors.
fn provider_error(e: &ProviderError) -> AgentApiError {
    AgentApiError::from_error(e)
}

/// Logs one model call that reached the provider: run, model, duration, the usage the
/// provider reported (`None` when it never answered) and the outcome.
fn log_model_call(
    cx: &Cx<'_, '_>,
    model: &ModelRecord,
    stream: bool,
    started: Instant,
    usage: Option<&Value>,
    outcome: &Result<Value, AgentApiError>,
) {
    let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let run_id = cx.call.run_id;
    let usage = usage.map(Value::to_string).unwrap_or_default();
    match outcome {
        Ok(_) => tracing::info!(
            %run_id, model_id = %model.model_id, stream, duration_ms = ms, outcome = "ok",
            usage = %usage, "model called"
        ),
        Err(e) => tracing::info!(
            %run_id, model_id = %model.model_id, stream, duration_ms = ms, outcome = %e.code,
            message = %e.message, usage = %usage, "model call failed"
        ),
    }
}
