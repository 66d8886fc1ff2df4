//! The decisions of the tool loop, as pure functions: which models to try and in what
//! order, what a failed model call leads to, whether a round may offer tools, what a tool
//! call is called and what its result looks like to the model, how usage adds up, and
//! which `run.failed` code ends a run.
//!
//! The I/O loop (`agent`) only asks these questions and carries out the answers.

use sb_runner::sb_protocol::context::AgentResources;
use sb_runner::sb_protocol::error::{AgentApiError, ErrorCode, run_failure};
use sb_runner::sb_protocol::manifest::ModelOp;
use serde_json::{Map, Value, json};

use crate::config::ModelSelection;

/// `run.failed` codes of this runner (dotted, `runner.` prefix, SPEC §4.3).
pub mod codes {
    /// The agent's `runner_config` cannot be used.
    pub const INVALID_CONFIG: &str = "runner.invalid_config";
    /// No language model is granted to the run (or none of the configured ones).
    pub const NO_MODEL: &str = "runner.no_model";
    /// Every model failed with a retryable error (the provider is down or overloaded).
    pub const MODEL_UNAVAILABLE: &str = "runner.model_unavailable";
    /// A model refused or failed the call for good.
    pub const MODEL_ERROR: &str = "runner.model_error";
    /// A per-run budget of the host is used up (model calls, tool calls, output or tool
    /// result characters).
    pub const BUDGET_EXCEEDED: &str = "runner.budget_exceeded";
    /// The model still asked for tools when `max_rounds` model calls were made.
    pub const MAX_ROUNDS: &str = "runner.max_rounds";
    /// A Host API call the loop depends on failed.
    pub const HOST_ERROR: &str = "runner.host_error";
    /// A tool call was interrupted and its effect is unknown: the run stops rather than let
    /// the model try again.
    pub const TOOL_OUTCOME_UNKNOWN: &str = "runner.tool_outcome_unknown";
    /// The message has no text to answer.
    pub const EMPTY_INPUT: &str = "runner.empty_input";
}

/// How a run ends when it does not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The `run.failed` code.
    pub code: &'static str,
    /// The message.
    pub message: String,
    /// Whether a new run could succeed.
    pub retryable: bool,
}

impl Failure {
    /// A failure with `code`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retryable: false,
        }
    }

    #[must_use]
    fn retryable(mut self, retryable: bool) -> Self {
        self.retryable = retryable;
        self
    }
}

/// The failure for a Host API error that ends the run (`what` names the call): a cancel
/// stays `cancelled`, a passed deadline is `timeout`, a budget refusal
/// [`codes::BUDGET_EXCEEDED`] (naming the budget from the error's details), anything else
/// `fallback`.
#[must_use]
pub fn failure_of(error: &AgentApiError, what: &str, fallback: &'static str) -> Failure {
    match error.error_code() {
        Some(ErrorCode::Cancelled) => Failure::new(run_failure::CANCELLED, error.message.clone()),
        Some(ErrorCode::DeadlineExceeded) => {
            Failure::new(run_failure::TIMEOUT, format!("{what}: {}", error.message)).retryable(true)
        }
        Some(ErrorCode::BudgetExceeded) => {
            let budget = error
                .details
                .get("budget")
                .and_then(Value::as_str)
                .unwrap_or("a per-run budget");
            Failure::new(
                codes::BUDGET_EXCEEDED,
                format!(
                    "{what} refused: {budget} is used up for this run ({})",
                    error.message
                ),
            )
        }
        _ => Failure::new(
            fallback,
            format!("{what} failed: {} ({})", error.message, error.code),
        )
        .retryable(error.retryable),
    }
}

/// A model the loop may call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChoice {
    /// The model id (opaque).
    pub model_id: String,
    /// Streamed (`invoke_llm_stream`) when granted, else a plain call (`invoke_llm`).
    pub stream: bool,
}

/// The models to try, in order: the configured ones that are granted (`invoke` or
/// `stream`), or, when the config names none, every granted LLM in the host's grant order.
/// Configured models that are not granted are skipped (the host would refuse them), and
/// returned separately so the run can say why it has no model.
#[must_use]
pub fn model_order(
    selection: &ModelSelection,
    resources: &AgentResources,
) -> (Vec<ModelChoice>, Vec<String>) {
    let choice = |id: &str| {
        let stream = resources.allows_model(id, ModelOp::Stream);
        (stream || resources.allows_model(id, ModelOp::Invoke)).then(|| ModelChoice {
            model_id: id.to_owned(),
            stream,
        })
    };
    if selection.0.is_empty() {
        let all = resources
            .models
            .iter()
            .filter_map(|m| choice(&m.model_id))
            .collect();
        return (all, Vec::new());
    }
    let mut order = Vec::new();
    let mut ungranted = Vec::new();
    for id in &selection.0 {
        match choice(id) {
            Some(c) => order.push(c),
            None => ungranted.push(id.clone()),
        }
    }
    (order, ungranted)
}

/// The rerank model to apply: the configured one if granted for `rerank`, else the first
/// rerank model granted (the host grants rerank models only through config selectors).
#[must_use]
pub fn rerank_model(configured: Option<&str>, resources: &AgentResources) -> Option<String> {
    match configured {
        Some(id) => resources
            .allows_model(id, ModelOp::Rerank)
            .then(|| id.to_owned()),
        None => resources
            .models
            .iter()
            .find(|m| m.operations.contains(&ModelOp::Rerank))
            .map(|m| m.model_id.clone()),
    }
}

/// What follows a failed model call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterModelFailure {
    /// Call the model at this index of the order (the next fallback).
    Fallback(usize),
    /// End the run.
    Fail(Failure),
}

/// The fallback rule: a retryable failure (`unavailable`, `rate_limited`: the provider is
/// down, overloaded or answered 5xx/429 after the host's own retries) moves to the next
/// model, as long as the failed call streamed nothing to the user (a half-streamed answer
/// cannot be taken back, so it is not followed by another model's whole answer). Anything
/// else ends the run: budget, cancel and deadline with their own codes, a call the model
/// refused for good (`invalid_argument`, `runtime_error`, …) as [`codes::MODEL_ERROR`], and
/// the last model's retryable failure as [`codes::MODEL_UNAVAILABLE`] (retryable).
#[must_use]
pub fn after_model_failure(
    error: &AgentApiError,
    streamed: bool,
    index: usize,
    models: usize,
) -> AfterModelFailure {
    let terminal = matches!(
        error.error_code(),
        Some(ErrorCode::Cancelled | ErrorCode::DeadlineExceeded | ErrorCode::BudgetExceeded)
    );
    if terminal {
        return AfterModelFailure::Fail(failure_of(error, "the model call", codes::MODEL_ERROR));
    }
    if error.retryable && !streamed && index + 1 < models {
        return AfterModelFailure::Fallback(index + 1);
    }
    let code = if error.retryable {
        codes::MODEL_UNAVAILABLE
    } else {
        codes::MODEL_ERROR
    };
    AfterModelFailure::Fail(failure_of(error, "the model call", code))
}

/// Whether round `round` (1-based) may offer tools: every round but the last, so the last
/// model call of a run has to answer in words.
#[must_use]
pub fn offer_tools(round: u32, max_rounds: u32, have_tools: bool) -> bool {
    have_tools && round < max_rounds
}

/// Whether another round may follow round `round` (for tool results or steering input).
#[must_use]
pub fn may_continue(round: u32, max_rounds: u32) -> bool {
    round < max_rounds
}

/// What follows a model's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterAnswer {
    /// Execute the tool calls, then call the model again.
    RunTools,
    /// The model answered in words: finish (unless steering input arrived).
    Answered,
    /// End the run.
    Fail(Failure),
}

/// The answer rule. Tool calls are run only when tools were offered in that round; calls
/// the model makes anyway (some servers let a model hallucinate tools) are ignored when it
/// also answered in words, and end the run otherwise: [`codes::MAX_ROUNDS`] when the tools
/// were withheld because it was the last round, [`codes::MODEL_ERROR`] when the run has no
/// tools at all. An answer with neither words nor calls is [`codes::MODEL_ERROR`] too: the
/// host would refuse an empty message, and the user would get nothing.
#[must_use]
pub fn after_answer(
    has_text: bool,
    has_calls: bool,
    offered: bool,
    have_tools: bool,
    max_rounds: u32,
) -> AfterAnswer {
    match (has_calls, offered, has_text) {
        (true, true, _) => AfterAnswer::RunTools,
        (_, _, true) => AfterAnswer::Answered,
        (true, false, false) if have_tools => AfterAnswer::Fail(Failure::new(
            codes::MAX_ROUNDS,
            format!(
                "the model still asked for tools after {max_rounds} rounds (max_rounds);                  raise max_rounds or narrow the task"
            ),
        )),
        (true, false, false) => AfterAnswer::Fail(Failure::new(
            codes::MODEL_ERROR,
            "the model asked for tools, but this agent is granted none",
        )),
        (false, _, false) => AfterAnswer::Fail(Failure::new(
            codes::MODEL_ERROR,
            "the model answered nothing",
        )),
    }
}

/// The failure that ends the run for a tool error that [`tool_failure_ends_run`].
#[must_use]
pub fn tool_failure(error: &AgentApiError, tool: &str) -> Failure {
    let what = format!("tool {tool}");
    if error.error_code() == Some(ErrorCode::ToolOutcomeUnknown) {
        return Failure::new(
            codes::TOOL_OUTCOME_UNKNOWN,
            format!("{what}: {} (it is not called again)", error.message),
        );
    }
    failure_of(error, &what, codes::HOST_ERROR)
}

/// One tool call the model asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallRequest {
    /// The model's id of the call (answered by the tool message's `tool_call_id`).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments object, or why the model's arguments are unusable.
    pub arguments: Result<Map<String, Value>, String>,
    /// The arguments as the model wrote them (repeated in the assistant message).
    pub arguments_text: String,
}

impl ToolCallRequest {
    /// The call in the assistant message that precedes its result (OpenAI shape).
    #[must_use]
    pub fn to_message_call(&self) -> Value {
        json!({"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments_text}})
    }
}

/// The tool calls of an answer message (`message.tool_calls`, OpenAI shape with
/// `arguments` as JSON text). A call without an id gets one from its position, so its
/// result can still be matched.
#[must_use]
pub fn tool_calls(message: &Value, round: u32) -> Vec<ToolCallRequest> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, call)| {
            let function = call.get("function")?;
            let name = function.get("name")?.as_str()?.trim().to_owned();
            if name.is_empty() {
                return None;
            }
            let id = call
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map_or_else(|| format!("call_{round}_{i}"), str::to_owned);
            let raw = function.get("arguments");
            let arguments = match raw {
                None | Some(Value::Null) => Ok(Map::new()),
                Some(Value::Object(map)) => Ok(map.clone()),
                Some(Value::String(text)) => parse_arguments(text),
                Some(other) => Err(format!("arguments must be a JSON object, got {other}")),
            };
            // Empty arguments are sent back as `{}`: strict servers refuse `""` in history.
            let arguments_text = match raw {
                None | Some(Value::Null) => "{}".to_owned(),
                Some(Value::String(text)) if text.trim().is_empty() => "{}".to_owned(),
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
            };
            Some(ToolCallRequest {
                id,
                name,
                arguments,
                arguments_text,
            })
        })
        .collect()
}

/// Arguments as the model wrote them: a JSON object (empty text counts as `{}`).
fn parse_arguments(text: &str) -> Result<Map<String, Value>, String> {
    if text.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!("arguments must be a JSON object, got {other}")),
        Err(e) => Err(format!("arguments are not valid JSON: {e}")),
    }
}

/// Longest `call_id` the host accepts.
pub const MAX_CALL_ID_CHARS: usize = 255;

/// The `call_id` of the `index`-th tool call of round `round`: unique within the run (the
/// host executes a call id at most once per run, and models reuse their own ids across
/// rounds), stable for the same call, within the host's 255 characters.
#[must_use]
pub fn call_id(round: u32, index: usize, model_call_id: &str) -> String {
    let id = format!("r{round}.{index}.{model_call_id}");
    id.chars().take(MAX_CALL_ID_CHARS).collect()
}

/// The content of the tool message for a tool's `result`: text as is, anything else as
/// JSON, cut to `max_chars` with a note saying so (the model should know it did not see
/// everything).
#[must_use]
pub fn tool_result_text(result: &Value, max_chars: usize) -> String {
    let text = match result {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let total = text.chars().count();
    if total <= max_chars {
        return text;
    }
    let mut cut: String = text.chars().take(max_chars).collect();
    cut.push_str(&format!(
        "\n[truncated: {} of {total} characters shown]",
        max_chars
    ));
    cut
}

/// The content of the tool message for a failed call: the error as JSON, so the model can
/// tell a failure from a result and decide what to do next.
#[must_use]
pub fn tool_error_text(code: &str, message: &str) -> String {
    json!({"error": {"code": code, "message": message}}).to_string()
}

/// Whether a failed tool call ends the run instead of being reported to the model:
/// budgets, cancels, deadlines and a call whose outcome is unknown (it must not be retried
/// by a model that thinks it failed).
#[must_use]
pub fn tool_failure_ends_run(error: &AgentApiError) -> bool {
    matches!(
        error.error_code(),
        Some(
            ErrorCode::BudgetExceeded
                | ErrorCode::Cancelled
                | ErrorCode::DeadlineExceeded
                | ErrorCode::ToolOutcomeUnknown
        )
    )
}

/// Text to stream before a round's first text when earlier rounds already produced some,
/// so two rounds' words do not run together.
#[must_use]
pub fn round_separator(answered_so_far: &str) -> Option<&'static str> {
    match answered_so_far.chars().last() {
        None => None,
        Some('\n') => None,
        Some(_) => Some("\n\n"),
    }
}

/// Model usage summed over a run's calls: every number of the providers' usage objects
/// (nested ones too, e.g. `prompt_tokens_details.cached_tokens`), plus the count of model
/// and tool calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    totals: Map<String, Value>,
    model_calls: u64,
    tool_calls: u64,
}

impl Usage {
    /// Adds one model call and its usage object (anything but an object adds only the call).
    pub fn add_model_call(&mut self, usage: Option<&Value>) {
        self.model_calls += 1;
        if let Some(Value::Object(u)) = usage {
            add_into(&mut self.totals, u);
        }
    }

    /// Adds one executed tool call.
    pub fn add_tool_call(&mut self) {
        self.tool_calls += 1;
    }

    /// The `usage` of the terminal result.
    #[must_use]
    pub fn to_map(&self) -> Map<String, Value> {
        let mut out = self.totals.clone();
        out.insert("model_calls".into(), json!(self.model_calls));
        out.insert("tool_calls".into(), json!(self.tool_calls));
        out
    }
}

fn add_into(totals: &mut Map<String, Value>, add: &Map<String, Value>) {
    for (key, value) in add {
        match value {
            Value::Number(n) => {
                // Token counts stay integers; a fractional figure (a cost) is summed as such.
                let sum = match (totals.get(key), n.as_u64()) {
                    (Some(Value::Number(t)), Some(v)) if t.is_u64() => {
                        json!(t.as_u64().unwrap_or(0).saturating_add(v))
                    }
                    (Some(Value::Number(t)), _) => {
                        json!(t.as_f64().unwrap_or(0.0) + n.as_f64().unwrap_or(0.0))
                    }
                    _ => value.clone(),
                };
                totals.insert(key.clone(), sum);
            }
            Value::Object(inner) => {
                let entry = totals
                    .entry(key.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(slot) = entry {
                    add_into(slot, inner);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sb_runner::sb_protocol::context::ModelResource;

    fn resources(models: &[(&str, &[ModelOp])]) -> AgentResources {
        AgentResources {
            models: models
                .iter()
                .map(|(id, ops)| ModelResource {
                    model_id: (*id).to_owned(),
                    model_type: None,
                    provider: None,
                    operations: ops.to_vec(),
                })
                .collect(),
            ..AgentResources::default()
        }
    }

    const LLM: &[ModelOp] = &[ModelOp::Invoke, ModelOp::Stream];

    #[test]
    fn the_configured_order_wins_and_ungranted_models_are_named() {
        let res = resources(&[
            ("m1", LLM),
            ("m2", &[ModelOp::Invoke]),
            ("r1", &[ModelOp::Rerank]),
            ("m3", LLM),
        ]);
        let sel = ModelSelection(vec!["m3".into(), "ghost".into(), "m2".into(), "r1".into()]);
        let (order, ungranted) = model_order(&sel, &res);
        assert_eq!(
            order,
            [
                ModelChoice {
                    model_id: "m3".into(),
                    stream: true
                },
                ModelChoice {
                    model_id: "m2".into(),
                    stream: false
                },
            ]
        );
        assert_eq!(ungranted, ["ghost", "r1"]);
        let (all, none) = model_order(&ModelSelection::default(), &res);
        let ids: Vec<&str> = all.iter().map(|m| m.model_id.as_str()).collect();
        assert_eq!(ids, ["m1", "m2", "m3"], "every granted LLM, in grant order");
        assert!(none.is_empty());
        assert_eq!(rerank_model(None, &res).as_deref(), Some("r1"));
        assert_eq!(rerank_model(Some("r1"), &res).as_deref(), Some("r1"));
        assert_eq!(rerank_model(Some("m1"), &res), None);
        assert_eq!(rerank_model(None, &resources(&[("m1", LLM)])), None);
    }

    fn api_error(code: ErrorCode) -> AgentApiError {
        AgentApiError::new(code, "boom")
    }

    #[test]
    fn retryable_failures_fall_back_until_the_last_model() {
        let unavailable = api_error(ErrorCode::Unavailable);
        assert_eq!(
            after_model_failure(&unavailable, false, 0, 3),
            AfterModelFailure::Fallback(1)
        );
        assert_eq!(
            after_model_failure(&api_error(ErrorCode::RateLimited), false, 1, 3),
            AfterModelFailure::Fallback(2)
        );
        let AfterModelFailure::Fail(last) = after_model_failure(&unavailable, false, 2, 3) else {
            panic!()
        };
        assert_eq!(
            (last.code, last.retryable),
            (codes::MODEL_UNAVAILABLE, true)
        );
        let AfterModelFailure::Fail(streamed) = after_model_failure(&unavailable, true, 0, 3)
        else {
            panic!()
        };
        assert_eq!(
            streamed.code,
            codes::MODEL_UNAVAILABLE,
            "no fallback after streamed text"
        );
        let AfterModelFailure::Fail(bad) =
            after_model_failure(&api_error(ErrorCode::InvalidArgument), false, 0, 3)
        else {
            panic!()
        };
        assert_eq!((bad.code, bad.retryable), (codes::MODEL_ERROR, false));
    }

    #[test]
    fn budgets_cancels_and_deadlines_end_the_run_with_their_own_codes() {
        let budget = api_error(ErrorCode::BudgetExceeded).with_detail("budget", "model_calls");
        let AfterModelFailure::Fail(f) = after_model_failure(&budget, false, 0, 3) else {
            panic!("a budget refusal never falls back")
        };
        assert_eq!(f.code, codes::BUDGET_EXCEEDED);
        assert!(f.message.contains("model_calls"), "{}", f.message);
        let AfterModelFailure::Fail(f) =
            after_model_failure(&api_error(ErrorCode::Cancelled), false, 0, 3)
        else {
            panic!()
        };
        assert_eq!(f.code, run_failure::CANCELLED);
        let f = failure_of(
            &api_error(ErrorCode::DeadlineExceeded),
            "x",
            codes::HOST_ERROR,
        );
        assert_eq!((f.code, f.retryable), (run_failure::TIMEOUT, true));
        let f = failure_of(
            &api_error(ErrorCode::NotFound),
            "history",
            codes::HOST_ERROR,
        );
        assert_eq!(f.code, codes::HOST_ERROR);
        assert!(
            f.message.starts_with("history failed: boom"),
            "{}",
            f.message
        );
    }

    #[test]
    fn the_last_round_offers_no_tools() {
        assert!(offer_tools(1, 3, true));
        assert!(offer_tools(2, 3, true));
        assert!(!offer_tools(3, 3, true));
        assert!(!offer_tools(1, 1, true));
        assert!(!offer_tools(1, 3, false));
        assert!(may_continue(2, 3));
        assert!(!may_continue(3, 3));
    }

    #[test]
    fn tool_calls_are_read_leniently_and_their_ids_are_unique_per_run() {
        let message = json!({"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}},
            {"type": "function", "function": {"name": "now", "arguments": ""}},
            {"id": "c3", "function": {"name": "bad", "arguments": "{not json"}},
            {"id": "c4", "function": {"name": "list", "arguments": "[1]"}},
            {"id": "c5", "function": {"name": " "}},
            {"id": "c6", "function": {"name": "obj", "arguments": {"a": 1}}},
        ]});
        let calls = tool_calls(&message, 2);
        let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["lookup", "now", "bad", "list", "obj"]);
        assert_eq!(calls[0].arguments.as_ref().unwrap()["q"], "x");
        assert_eq!(calls[1].id, "call_2_1");
        assert!(calls[1].arguments.as_ref().unwrap().is_empty());
        assert!(
            calls[2]
                .arguments
                .as_ref()
                .unwrap_err()
                .contains("not valid JSON")
        );
        assert!(
            calls[3]
                .arguments
                .as_ref()
                .unwrap_err()
                .contains("JSON object")
        );
        assert_eq!(calls[4].arguments.as_ref().unwrap()["a"], 1);
        assert!(tool_calls(&json!({"content": "hi"}), 1).is_empty());
        assert_eq!(
            calls[0].to_message_call(),
            json!({"id": "c1", "type": "function",
                   "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}})
        );
        assert_eq!(calls[1].to_message_call()["function"]["arguments"], "{}");
        assert_eq!(
            calls[4].to_message_call()["function"]["arguments"],
            r#"{"a":1}"#
        );

        assert_eq!(call_id(1, 0, "c1"), "r1.0.c1");
        assert_ne!(call_id(1, 0, "c1"), call_id(2, 0, "c1"));
        assert_eq!(
            call_id(1, 0, &"x".repeat(400)).chars().count(),
            MAX_CALL_ID_CHARS
        );
    }

    #[test]
    fn tool_results_are_text_and_cut_with_a_note() {
        assert_eq!(tool_result_text(&json!("plain"), 10), "plain");
        assert_eq!(
            tool_result_text(&json!({"days": 25}), 100),
            r#"{"days":25}"#
        );
        let cut = tool_result_text(&json!("x".repeat(50)), 10);
        assert!(cut.starts_with("xxxxxxxxxx\n[truncated: 10 of 50"), "{cut}");
        let err: Value = serde_json::from_str(&tool_error_text("unavailable", "down")).unwrap();
        assert_eq!(err["error"]["code"], "unavailable");
        assert!(tool_failure_ends_run(&api_error(ErrorCode::BudgetExceeded)));
        assert!(tool_failure_ends_run(&api_error(
            ErrorCode::ToolOutcomeUnknown
        )));
        assert!(!tool_failure_ends_run(&api_error(ErrorCode::Unavailable)));
        assert!(!tool_failure_ends_run(&api_error(ErrorCode::Unauthorized)));
    }

    #[test]
    fn answers_lead_to_tools_an_end_or_a_clear_failure() {
        assert_eq!(
            after_answer(false, true, true, true, 3),
            AfterAnswer::RunTools
        );
        assert_eq!(
            after_answer(true, true, true, true, 3),
            AfterAnswer::RunTools
        );
        assert_eq!(
            after_answer(true, false, true, true, 3),
            AfterAnswer::Answered
        );
        assert_eq!(
            after_answer(true, true, false, true, 3),
            AfterAnswer::Answered
        );
        let AfterAnswer::Fail(f) = after_answer(false, true, false, true, 3) else {
            panic!()
        };
        assert_eq!(f.code, codes::MAX_ROUNDS);
        assert!(f.message.contains("after 3 rounds"), "{}", f.message);
        let AfterAnswer::Fail(f) = after_answer(false, true, false, false, 3) else {
            panic!()
        };
        assert_eq!(f.code, codes::MODEL_ERROR);
        let AfterAnswer::Fail(f) = after_answer(false, false, true, true, 3) else {
            panic!()
        };
        assert_eq!(f.code, codes::MODEL_ERROR);
        let unknown = tool_failure(&api_error(ErrorCode::ToolOutcomeUnknown), "pay");
        assert_eq!(unknown.code, codes::TOOL_OUTCOME_UNKNOWN);
        let budget = tool_failure(
            &api_error(ErrorCode::BudgetExceeded).with_detail("budget", "tool_calls"),
            "lookup",
        );
        assert_eq!(budget.code, codes::BUDGET_EXCEEDED);
        assert!(
            budget
                .message
                .starts_with("tool lookup refused: tool_calls"),
            "{}",
            budget.message
        );
    }

    #[test]
    fn rounds_are_separated_once() {
        assert_eq!(round_separator(""), None);
        assert_eq!(round_separator("Let me check."), Some("\n\n"));
        assert_eq!(round_separator("Done\n"), None);
    }

    #[test]
    fn usage_adds_up_every_number() {
        let mut usage = Usage::default();
        usage.add_model_call(Some(&json!({"prompt_tokens": 10, "completion_tokens": 2,
            "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 4}, "model": "x"})));
        usage.add_model_call(Some(&json!({"prompt_tokens": 20, "completion_tokens": 3,
            "total_tokens": 23, "prompt_tokens_details": {"cached_tokens": 1}, "cost": 0.5})));
        usage.add_model_call(None);
        usage.add_tool_call();
        let map = usage.to_map();
        assert_eq!(map["prompt_tokens"], 30);
        assert_eq!(map["total_tokens"], 35);
        assert_eq!(map["prompt_tokens_details"]["cached_tokens"], 5);
        assert_eq!(map["cost"], 0.5);
        assert!(map.get("model").is_none());
        assert_eq!(
            (map["model_calls"].as_u64(), map["tool_calls"].as_u64()),
            (Some(3), Some(1))
        );
    }
}
