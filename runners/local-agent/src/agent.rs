//! The I/O loop of one run: gather the context through the Host API, then model call, tool
//! calls, model call, … until the model answers in words. Every decision is delegated to
//! `plan`, `prompt` and `history`; this file only calls the host and emits results.
//!
//! ```text
//!  config ─▶ models ─▶ knowledge (+ rerank) ─▶ tools ─▶ system prompt ─▶ history (+ checkpoint)
//!     │
//!     ▼
//!  round 1..=max_rounds:  model (stream; fallback on retryable failure)
//!                         ├─ tool calls ─▶ call_tool each ─▶ results fed back ─▶ steering ─▶ next
//!                         └─ words ─▶ steering? ─▶ next round │ message.completed + run.completed
//! ```
//!
//! Results: a `message.delta` per text chunk as the model streams it, `tool.call.started` /
//! `tool.call.completed` around every tool call (with the `call_id` the host executed it
//! under), `message.completed` with everything the user was shown, and `run.completed`
//! carrying the summed model usage; or `run.failed` with a `runner.*` code (see
//! `plan::codes`), also with the usage so far.

use std::time::{SystemTime, UNIX_EPOCH};

use sb_runner::sb_protocol::error::{AgentApiError, ErrorCode};
use sb_runner::sb_protocol::manifest::{KnowledgeBaseOp, ToolOp};
use sb_runner::{EmitError, Emitter, HistoryPageParams, HostApi, LogLevel, Run};
use serde_json::{Map, Value, json};

use crate::config::AgentConfig;
use crate::history::{
    CHECKPOINT_KEY, Checkpoint, Turn, compact, history_budget, message_tokens, trim_to_budget,
    turn_of,
};
use crate::plan::{
    self, AfterAnswer, AfterModelFailure, Failure, ModelChoice, ToolCallRequest, Usage, codes,
};
use crate::prompt::{self, Chunk};

/// Transcript items per `history_page` call.
const HISTORY_PAGE_SIZE: u32 = 50;
/// Most `history_page` calls per run: 500 turns is far more than any window holds, and
/// bounds the work a very long conversation costs before its first checkpoint.
const MAX_HISTORY_PAGES: usize = 10;
/// Turns fetched past the budget, to be summarised when history is compacted: about what
/// a summary keeps (`history::SUMMARY_MAX_CHARS` / `SUMMARY_LINE_CHARS`, with margin).
const SUMMARY_TURNS: usize = 12;

/// Why the loop stopped early: a result of its own, or the emitter refusing (the host has
/// ended the run, e.g. after a cancel).
pub enum Stop {
    /// End the run with `run.failed`.
    Fail(Failure),
    /// Nothing more can be written.
    Emit(EmitError),
}

impl From<Failure> for Stop {
    fn from(f: Failure) -> Self {
        Self::Fail(f)
    }
}

impl From<EmitError> for Stop {
    fn from(e: EmitError) -> Self {
        Self::Emit(e)
    }
}

/// One run of the local agent.
pub struct Agent<'a> {
    run: &'a Run,
    out: &'a Emitter,
    api: &'a HostApi,
    config: AgentConfig,
    usage: Usage,
}

impl<'a> Agent<'a> {
    /// The agent for `run`, its `runner_config` parsed.
    pub fn new(run: &'a Run, out: &'a Emitter) -> Result<Self, Failure> {
        let config = AgentConfig::parse(&run.context().config)
            .map_err(|e| Failure::new(codes::INVALID_CONFIG, e.to_string()))?;
        Ok(Self {
            run,
            out,
            api: run.api(),
            config,
            usage: Usage::default(),
        })
    }

    /// The usage so far (for the terminal result).
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    fn log(&self, level: LogLevel, message: impl Into<String>) {
        let _ = self.out.log(level, message);
    }

    /// Runs the loop to its end; `Ok` once `run.completed` is written.
    pub fn execute(&mut self) -> Result<(), Stop> {
        let ctx = self.run.context();
        let (models, ungranted) = plan::model_order(&self.config.models, &ctx.resources);
        if models.is_empty() {
            let why = if ungranted.is_empty() {
                "no language model is granted to this agent: select one in runner_config.model \
                 (or grant one in resource_policy.allowed_model_uuids)"
                    .to_owned()
            } else {
                format!(
                    "none of the configured models is granted to this run: {}",
                    ungranted.join(", ")
                )
            };
            return Err(Failure::new(codes::NO_MODEL, why).into());
        }
        if !ungranted.is_empty() {
            self.log(
                LogLevel::Warn,
                format!(
                    "configured models not granted, skipped: {}",
                    ungranted.join(", ")
                ),
            );
        }
        let input = input_text(self.run);
        if input.is_empty() {
            return Err(
                Failure::new(codes::EMPTY_INPUT, "the message has no text to answer").into(),
            );
        }

        let chunks = self.knowledge(&input)?;
        let (funcs, tool_names) = self.tools()?;
        let system_prompt = prompt::render(&self.config.system_prompt, &self.variables());
        let knowledge = prompt::knowledge_block(&chunks);
        let fixed = message_tokens(&system_prompt)
            + knowledge.as_deref().map_or(0, message_tokens)
            + message_tokens(&input)
            + crate::history::estimate_tokens(&Value::Array(funcs.clone()).to_string());
        let (history, summary) = self.history(fixed)?;
        let system = prompt::system_message(&[
            Some(system_prompt),
            knowledge,
            summary.as_deref().and_then(prompt::summary_block),
        ]);
        let mut messages = prompt::assemble(system, &history, &input);
        self.tool_loop(&models, &mut messages, &funcs, &tool_names)
    }

    fn variables(&self) -> std::collections::BTreeMap<String, String> {
        let ctx = self.run.context();
        let meta = |key: &str| {
            ctx.runtime
                .metadata
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let conversation = ctx.conversation.as_ref();
        prompt::variables(
            &self.config.prompt_variables,
            [
                (
                    "actor_name",
                    ctx.actor.as_ref().and_then(|a| a.actor_name.clone()),
                ),
                (
                    "actor_id",
                    ctx.actor.as_ref().and_then(|a| a.actor_id.clone()),
                ),
                (
                    "conversation_id",
                    conversation.and_then(|c| c.conversation_id.clone()),
                ),
                (
                    "bot_id",
                    conversation
                        .and_then(|c| c.bot_id.clone())
                        .or_else(|| meta("bot_id")),
                ),
                (
                    "workspace_id",
                    conversation
                        .and_then(|c| c.workspace_id.clone())
                        .or_else(|| meta("workspace_id")),
                ),
                ("date", Some(prompt::utc_date(now()))),
            ],
        )
    }

    /// `retrieve_knowledge` on every granted knowledge base, merged, optionally reranked.
    /// A base that fails (deleted since the run started, a search error) is skipped with a
    /// log line: an answer without it beats no answer.
    fn knowledge(&mut self, query: &str) -> Result<Vec<Chunk>, Stop> {
        let ctx = self.run.context();
        let mut per_kb = Vec::new();
        for kb in &ctx.resources.knowledge_bases {
            if !kb.operations.contains(&KnowledgeBaseOp::Retrieve) {
                continue;
            }
            match self
                .api
                .retrieve_knowledge(&kb.kb_id, query, Some(self.config.knowledge_top_k))
            {
                Ok(answer) => per_kb.push(
                    answer
                        .get("results")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(|hit| Chunk::from_hit(&kb.kb_id, hit))
                        .collect(),
                ),
                Err(e) if ends_run(&e) => {
                    return Err(
                        plan::failure_of(&e, "knowledge retrieval", codes::HOST_ERROR).into(),
                    );
                }
                Err(e) => self.log(
                    LogLevel::Warn,
                    format!(
                        "knowledge base {} skipped: {} ({})",
                        kb.kb_id, e.message, e.code
                    ),
                ),
            }
        }
        let top_k = usize::try_from(self.config.knowledge_top_k).unwrap_or(usize::MAX);
        let chunks = prompt::merge_chunks(per_kb, top_k);
        let Some(reranker) =
            plan::rerank_model(self.config.rerank_model.as_deref(), &ctx.resources)
        else {
            return Ok(chunks);
        };
        if chunks.len() < 2 {
            return Ok(chunks);
        }
        let documents: Vec<Value> = chunks.iter().map(|c| json!(c.content)).collect();
        let rerank_top_k = self.config.rerank_top_k;
        match self
            .api
            .invoke_rerank(&reranker, query, &documents, Some(rerank_top_k))
        {
            Ok(answer) => Ok(prompt::apply_rerank(
                chunks,
                &answer,
                usize::try_from(rerank_top_k).unwrap_or(usize::MAX),
            )),
            Err(e) if ends_run(&e) => {
                Err(plan::failure_of(&e, "the rerank call", codes::MODEL_ERROR).into())
            }
            Err(e) => {
                self.log(
                    LogLevel::Warn,
                    format!(
                        "rerank skipped, search order kept: {} ({})",
                        e.message, e.code
                    ),
                );
                Ok(chunks)
            }
        }
    }

    /// The tools the model may call: every granted tool with `call`, described by
    /// `get_tool_detail` when that is granted too (else by the run's resource list).
    fn tools(&self) -> Result<(Vec<Value>, Vec<String>), Stop> {
        let mut funcs = Vec::new();
        let mut names = Vec::new();
        for tool in &self.run.context().resources.tools {
            if !tool.operations.contains(&ToolOp::Call) {
                continue;
            }
            let mut description = tool.description.clone().unwrap_or_default();
            let mut parameters = None;
            if tool.operations.contains(&ToolOp::Detail) {
                match self.api.get_tool_detail(&tool.tool_name) {
                    Ok(detail) => {
                        let detail = &detail["tool"];
                        if let Some(d) = detail.get("description").and_then(Value::as_str) {
                            d.clone_into(&mut description);
                        }
                        parameters = detail.get("parameters").cloned();
                    }
                    Err(e) if ends_run(&e) => {
                        return Err(plan::failure_of(&e, "tool detail", codes::HOST_ERROR).into());
                    }
                    Err(e) => self.log(
                        LogLevel::Warn,
                        format!(
                            "tool {} offered without its schema: {}",
                            tool.tool_name, e.message
                        ),
                    ),
                }
            }
            funcs.push(prompt::func(
                &tool.tool_name,
                &description,
                parameters.as_ref(),
            ));
            names.push(tool.tool_name.clone());
        }
        Ok((funcs, names))
    }

    /// The prior turns that fit, and the summary of the older ones (from the checkpoint, or
    /// from a new compaction written back to state).
    fn history(&mut self, fixed: u64) -> Result<(Vec<Turn>, Option<String>), Stop> {
        let ctx = self.run.context();
        let Some(conversation) = ctx
            .conversation
            .as_ref()
            .and_then(|c| c.conversation_id.clone())
        else {
            return Ok((Vec::new(), None));
        };
        if !ctx.context.available_apis.history_page {
            return Ok((Vec::new(), None));
        }
        let window = ctx
            .runtime
            .metadata
            .get("model_context_window_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(self.config.context_window_tokens);
        let budget = history_budget(window, self.config.max_output_tokens, fixed);
        let mut checkpoint =
            Checkpoint::read(ctx.state.conversation.get(CHECKPOINT_KEY), &conversation);
        let turns = loop {
            let summary_tokens = checkpoint
                .as_ref()
                .and_then(|c| prompt::summary_block(&c.summary))
                .map_or(0, |s| message_tokens(&s));
            let after = checkpoint.as_ref().map(|c| c.covers_until.clone());
            match self.fetch_turns(after, budget.saturating_sub(summary_tokens)) {
                Ok(turns) => break turns,
                // The host no longer accepts the checkpoint's cursor: start over without it.
                Err(e)
                    if checkpoint.is_some()
                        && e.error_code() == Some(ErrorCode::InvalidArgument) =>
                {
                    self.log(
                        LogLevel::Warn,
                        "compaction checkpoint ignored: its cursor is refused",
                    );
                    checkpoint = None;
                }
                Err(e) if ends_run(&e) => {
                    return Err(plan::failure_of(&e, "history", codes::HOST_ERROR).into());
                }
                Err(e) => {
                    self.log(
                        LogLevel::Warn,
                        format!("answering without history: {} ({})", e.message, e.code),
                    );
                    return Ok((Vec::new(), None));
                }
            }
        };
        let summary_tokens = checkpoint
            .as_ref()
            .and_then(|c| prompt::summary_block(&c.summary))
            .map_or(0, |s| message_tokens(&s));
        let tokens_before: u64 = summary_tokens + turns.iter().map(Turn::tokens).sum::<u64>();
        let trimmed = trim_to_budget(turns, budget.saturating_sub(summary_tokens));
        if trimmed.dropped.is_empty() {
            return Ok((trimmed.kept, checkpoint.map(|c| c.summary)));
        }
        let Some(next) = compact(
            checkpoint.as_ref(),
            &trimmed.dropped,
            &conversation,
            tokens_before,
            now(),
        ) else {
            return Ok((trimmed.kept, checkpoint.map(|c| c.summary)));
        };
        if ctx.context.available_apis.state {
            match self
                .api
                .state_set("conversation", CHECKPOINT_KEY, next.to_value())
            {
                Ok(_) => {}
                Err(e) if ends_run(&e) => {
                    return Err(
                        plan::failure_of(&e, "the checkpoint write", codes::HOST_ERROR).into(),
                    );
                }
                Err(e) => self.log(
                    LogLevel::Warn,
                    format!(
                        "compaction checkpoint not saved: {} ({})",
                        e.message, e.code
                    ),
                ),
            }
        }
        Ok((trimmed.kept, Some(next.summary)))
    }

    /// Prior turns newest first, paging backwards (after the checkpoint's cursor, when
    /// given) until the pages end or enough turns past `budget` are in hand to summarise.
    fn fetch_turns(&self, after: Option<String>, budget: u64) -> Result<Vec<Turn>, AgentApiError> {
        let event_id = self.run.context().event.event_id.clone();
        let mut turns: Vec<Turn> = Vec::new();
        let mut before: Option<String> = None;
        let mut tokens = 0u64;
        let mut past_budget = 0usize;
        for _ in 0..MAX_HISTORY_PAGES {
            let page = self.api.history_page(&HistoryPageParams {
                before_cursor: before.clone(),
                after_cursor: after.clone(),
                limit: Some(HISTORY_PAGE_SIZE),
                ..HistoryPageParams::default()
            })?;
            for item in page
                .get("items")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(turn) = turn_of(item, &event_id) {
                    tokens += turn.tokens();
                    if tokens > budget {
                        past_budget += 1;
                    }
                    turns.push(turn);
                }
            }
            let next = page.get("next_cursor").and_then(Value::as_str);
            let more = page
                .get("has_more")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            match next {
                Some(cursor) if more && past_budget < SUMMARY_TURNS => {
                    before = Some(cursor.to_owned());
                }
                _ => break,
            }
        }
        Ok(turns)
    }

    /// The bounded loop (see the module docs).
    fn tool_loop(
        &mut self,
        models: &[ModelChoice],
        messages: &mut Vec<Value>,
        funcs: &[Value],
        tool_names: &[String],
    ) -> Result<(), Stop> {
        let max_rounds = self.config.max_rounds;
        let have_tools = !funcs.is_empty();
        let mut current = 0usize;
        let mut shown = String::new();
        for round in 1..=max_rounds {
            if self.run.is_cancelled() {
                return Err(cancelled(self.run).into());
            }
            let offered = plan::offer_tools(round, max_rounds, have_tools);
            let offer: &[Value] = if offered { funcs } else { &[] };
            let (message, text) =
                self.call_model(models, &mut current, messages, offer, &mut shown)?;
            let calls = plan::tool_calls(&message, round);
            match plan::after_answer(
                !text.trim().is_empty(),
                !calls.is_empty(),
                offered,
                have_tools,
                max_rounds,
            ) {
                AfterAnswer::Fail(f) => return Err(f.into()),
                AfterAnswer::RunTools => {
                    messages.push(json!({
                        "role": "assistant",
                        "content": if text.is_empty() { Value::Null } else { json!(text) },
                        "tool_calls": calls.iter().map(ToolCallRequest::to_message_call).collect::<Vec<_>>(),
                    }));
                    for (index, call) in calls.iter().enumerate() {
                        let content = self.call_tool(round, index, call, tool_names)?;
                        messages.push(
                            json!({"role": "tool", "tool_call_id": call.id, "content": content}),
                        );
                    }
                    // The steering point of a tool batch: after its results, before the next call.
                    self.absorb_steering(messages)?;
                }
                AfterAnswer::Answered => {
                    if plan::may_continue(round, max_rounds) {
                        let mut follow_up = vec![json!({"role": "assistant", "content": text})];
                        if self.absorb_steering(&mut follow_up)? {
                            messages.extend(follow_up);
                            continue;
                        }
                    }
                    self.out.completed_text(shown.clone())?;
                    let mut done = Map::new();
                    done.insert("type".into(), json!("run.completed"));
                    done.insert("data".into(), json!({"finish_reason": "stop"}));
                    done.insert("usage".into(), Value::Object(self.usage.to_map()));
                    self.out.raw(Value::Object(done))?;
                    return Ok(());
                }
            }
        }
        Err(Failure::new(
            codes::MAX_ROUNDS,
            format!("no answer within {max_rounds} rounds (max_rounds)"),
        )
        .into())
    }

    /// One model call of a round, falling back along `models` from `*current` (which is
    /// left at the model that answered: later rounds start there instead of retrying a
    /// model that is down). Streams the text as it comes; returns the answer message and its
    /// text.
    fn call_model(
        &mut self,
        models: &[ModelChoice],
        current: &mut usize,
        messages: &[Value],
        funcs: &[Value],
        shown: &mut String,
    ) -> Result<(Value, String), Stop> {
        let extra = (!self.config.model_args.is_empty()).then_some(&self.config.model_args);
        loop {
            let model = &models[*current];
            let mut text = String::new();
            let mut emit_error: Option<EmitError> = None;
            let out = self.out;
            let mut show = |piece: &str| {
                if piece.is_empty() || emit_error.is_some() {
                    return;
                }
                let mut chunk = String::new();
                if text.is_empty()
                    && let Some(sep) = plan::round_separator(shown)
                {
                    chunk.push_str(sep);
                }
                chunk.push_str(piece);
                match out.delta(chunk.clone()) {
                    Ok(()) => {
                        shown.push_str(&chunk);
                        text.push_str(piece);
                    }
                    Err(e) => emit_error = Some(e),
                }
            };
            let answer = if model.stream {
                self.api
                    .invoke_llm_stream(&model.model_id, messages, funcs, extra, |data| {
                        if let Some(piece) = data.pointer("/chunk/content").and_then(Value::as_str)
                        {
                            show(piece);
                        }
                    })
            } else {
                self.api
                    .invoke_llm(&model.model_id, messages, funcs, extra)
                    .inspect(|a| {
                        if let Some(piece) = a.pointer("/message/content").and_then(Value::as_str) {
                            show(piece);
                        }
                    })
            };
            if let Some(e) = emit_error {
                return Err(e.into());
            }
            match answer {
                Ok(answer) => {
                    self.usage.add_model_call(answer.get("usage"));
                    let message = answer.get("message").cloned().unwrap_or(Value::Null);
                    return Ok((message, text));
                }
                Err(e) => {
                    match plan::after_model_failure(&e, !text.is_empty(), *current, models.len()) {
                        AfterModelFailure::Fallback(next) => {
                            self.log(
                                LogLevel::Warn,
                                format!(
                                    "model {} failed ({}: {}); falling back to {}",
                                    model.model_id, e.code, e.message, models[next].model_id
                                ),
                            );
                            *current = next;
                        }
                        AfterModelFailure::Fail(f) => return Err(f.into()),
                    }
                }
            }
        }
    }

    /// Executes one tool call under its run-unique `call_id` and returns the tool message
    /// content for the model (the result, or the error). Emits `tool.call.started` and
    /// `tool.call.completed`.
    fn call_tool(
        &mut self,
        round: u32,
        index: usize,
        call: &ToolCallRequest,
        tool_names: &[String],
    ) -> Result<String, Stop> {
        let call_id = plan::call_id(round, index, &call.id);
        let parameters = call.arguments.clone().unwrap_or_default();
        self.out.result(
            "tool.call.started",
            json!({"tool_call_id": call_id, "tool_name": call.name, "parameters": parameters}),
        )?;
        let refused = if !tool_names.contains(&call.name) {
            Some(("not_found", format!("there is no tool named {}", call.name)))
        } else {
            call.arguments
                .as_ref()
                .err()
                .map(|why| ("invalid_argument", why.clone()))
        };
        if let Some((code, message)) = refused {
            self.out.result(
                "tool.call.completed",
                json!({"tool_call_id": call_id, "tool_name": call.name, "error": message}),
            )?;
            return Ok(plan::tool_error_text(code, &message));
        }
        self.usage.add_tool_call();
        match self.api.call_tool(&call.name, &parameters, Some(&call_id)) {
            Ok(answer) => {
                let result = answer.get("result").cloned().unwrap_or(Value::Null);
                self.out.result(
                    "tool.call.completed",
                    json!({"tool_call_id": call_id, "tool_name": call.name, "result": result}),
                )?;
                Ok(plan::tool_result_text(
                    &result,
                    self.config.tool_result_max_chars,
                ))
            }
            Err(e) => {
                self.out.result(
                    "tool.call.completed",
                    json!({"tool_call_id": call_id, "tool_name": call.name,
                           "error": format!("{}: {}", e.code, e.message)}),
                )?;
                if plan::tool_failure_ends_run(&e) {
                    return Err(plan::tool_failure(&e, &call.name).into());
                }
                Ok(plan::tool_error_text(&e.code, &e.message))
            }
        }
    }

    /// Appends the user's follow-up messages claimed by this run since the last pull (when
    /// the run may pull them); true if there were any.
    fn absorb_steering(&mut self, messages: &mut Vec<Value>) -> Result<bool, Stop> {
        if !self.run.context().context.available_apis.steering_pull {
            return Ok(false);
        }
        let items = match self.api.steering_pull(Some("all"), None) {
            Ok(answer) => answer
                .get("items")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            Err(e) if ends_run(&e) => {
                return Err(plan::failure_of(&e, "steering pull", codes::HOST_ERROR).into());
            }
            Err(e) => {
                self.log(
                    LogLevel::Warn,
                    format!("steering pull failed: {} ({})", e.message, e.code),
                );
                return Ok(false);
            }
        };
        let mut any = false;
        for item in items {
            let text = item_text(&item["input"]);
            if !text.is_empty() {
                messages.push(prompt::user_message(&text));
                any = true;
            }
        }
        Ok(any)
    }
}

/// Host API errors after which the loop cannot go on (the run is over, or a budget is).
fn ends_run(error: &AgentApiError) -> bool {
    matches!(
        error.error_code(),
        Some(ErrorCode::Cancelled | ErrorCode::DeadlineExceeded | ErrorCode::BudgetExceeded)
    )
}

fn cancelled(run: &Run) -> Failure {
    Failure::new(
        sb_runner::sb_protocol::error::run_failure::CANCELLED,
        run.cancel_token()
            .reason()
            .unwrap_or_else(|| "cancelled".to_owned()),
    )
}

/// The text of the run's input: `input.text`, else its text blocks.
fn input_text(run: &Run) -> String {
    let input = &run.context().input;
    match input.text.as_deref().map(str::trim) {
        Some(text) if !text.is_empty() => text.to_owned(),
        _ => input
            .contents
            .iter()
            .filter_map(|c| c.as_text())
            .collect::<Vec<_>>()
            .join("\n")
            .trim()
            .to_owned(),
    }
}

/// The text of an `input` object as JSON (steering items carry the claimed event's input).
fn item_text(input: &Value) -> String {
    if let Some(text) = input.get("text").and_then(Value::as_str).map(str::trim)
        && !text.is_empty()
    {
        return text.to_owned();
    }
    input
        .get("contents")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|c| c.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|c| c.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n")
        .trim()
        .to_owned()
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steering_items_give_their_text() {
        assert_eq!(item_text(&json!({"text": " also this "})), "also this");
        assert_eq!(
            item_text(
                &json!({"text": "", "contents": [{"type": "text", "text": "a"},
                {"type": "image", "url": "u"}, {"type": "text", "text": "b"}]})
            ),
            "a\nb"
        );
        assert_eq!(item_text(&json!({})), "");
    }
}
