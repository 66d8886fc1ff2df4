//! The agent's `runner_config`, parsed and checked once per run.
//!
//! Every key is optional; the defaults below are what an agent created without a config
//! gets. The manifest's `config_schema` describes the same keys for the UI (a test keeps the
//! two in step). Unknown keys are ignored rather than refused: the host itself reads keys of
//! the same object (`timeout`), and a config written for a newer version of this runner
//! should still run. A known key with a wrong type or an out-of-range value fails the run
//! (`runner.invalid_config`, naming the key): silently running with a default the operator
//! did not choose would be worse.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

/// Config keys (also the `name`s of the manifest's `config_schema`).
pub mod keys {
    /// `model-fallback-selector`: `"<model id>"` or `{primary, fallbacks: [..]}`.
    pub const MODEL: &str = "model";
    /// `rerank-model-selector`: the rerank model applied to knowledge hits.
    pub const RERANK_MODEL: &str = "rerank_model";
    /// `knowledge-base-multi-selector`: knowledge bases to search (the resource policy may
    /// grant more; every granted one is searched).
    pub const KNOWLEDGE_BASES: &str = "knowledge_bases";
    /// The system prompt, with `{{variable}}` placeholders.
    pub const SYSTEM_PROMPT: &str = "system_prompt";
    /// Values of the prompt's placeholders.
    pub const PROMPT_VARIABLES: &str = "prompt_variables";
    /// Most model calls of the tool loop.
    pub const MAX_ROUNDS: &str = "max_rounds";
    /// Knowledge chunks retrieved per knowledge base.
    pub const KNOWLEDGE_TOP_K: &str = "knowledge_top_k";
    /// Chunks kept after reranking.
    pub const RERANK_TOP_K: &str = "rerank_top_k";
    /// Context window when the host does not know the model's.
    pub const CONTEXT_WINDOW_TOKENS: &str = "context_window_tokens";
    /// Tokens kept free for the model's answer.
    pub const MAX_OUTPUT_TOKENS: &str = "max_output_tokens";
    /// Extra request fields for the model (`temperature`, `max_tokens`, …).
    pub const MODEL_ARGS: &str = "model_args";
    /// Longest tool result given back to the model, in characters.
    pub const TOOL_RESULT_MAX_CHARS: &str = "tool_result_max_chars";
    /// The run deadline in seconds; read by the host, listed here so the schema is complete.
    pub const TIMEOUT: &str = "timeout";

    /// Every key this runner (or the host, for `timeout`) reads.
    pub const ALL: [&str; 13] = [
        MODEL,
        RERANK_MODEL,
        KNOWLEDGE_BASES,
        SYSTEM_PROMPT,
        PROMPT_VARIABLES,
        MAX_ROUNDS,
        KNOWLEDGE_TOP_K,
        RERANK_TOP_K,
        CONTEXT_WINDOW_TOKENS,
        MAX_OUTPUT_TOKENS,
        MODEL_ARGS,
        TOOL_RESULT_MAX_CHARS,
        TIMEOUT,
    ];
}

/// The system prompt of an agent that sets none.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant. Answer concisely. \
    Use the tools you are given when they help, and say so when you do not know.";

/// Default `max_rounds`: a lookup, a follow-up lookup and an answer fit comfortably, and the
/// host's default model-call budget (16 per run) still leaves room for fallbacks.
pub const DEFAULT_MAX_ROUNDS: u32 = 8;
/// Upper bound of `max_rounds`: beyond it a loop is runaway, not thorough.
pub const MAX_MAX_ROUNDS: u32 = 64;
/// Default `knowledge_top_k`, the host's own default for `retrieve_knowledge`.
pub const DEFAULT_KNOWLEDGE_TOP_K: u32 = 5;
/// The host's upper bound of `top_k`.
pub const MAX_TOP_K: u32 = 50;
/// Default `rerank_top_k`: a reranker exists to keep fewer, better chunks.
pub const DEFAULT_RERANK_TOP_K: u32 = 3;
/// Default `context_window_tokens`: what small local models (Llama 3.2 served by Ollama)
/// are run with; a larger window is used as soon as the host reports one.
pub const DEFAULT_CONTEXT_WINDOW_TOKENS: u64 = 8_192;
/// Default `max_output_tokens`: room for a few paragraphs of answer.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 1_024;
/// Default `tool_result_max_chars`: about 2 000 tokens, so a handful of tool results cannot
/// push the conversation out of a small context window.
pub const DEFAULT_TOOL_RESULT_MAX_CHARS: usize = 8_000;

/// The models of the `model` key, in order: the primary first, then its fallbacks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelSelection(pub Vec<String>);

/// A parsed `runner_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// `model`: the ordered model list (empty: every LLM the run is granted, in grant order).
    pub models: ModelSelection,
    /// `rerank_model`, if set.
    pub rerank_model: Option<String>,
    /// `system_prompt`.
    pub system_prompt: String,
    /// `prompt_variables`, as text.
    pub prompt_variables: BTreeMap<String, String>,
    /// `max_rounds`.
    pub max_rounds: u32,
    /// `knowledge_top_k`.
    pub knowledge_top_k: u32,
    /// `rerank_top_k`.
    pub rerank_top_k: u32,
    /// `context_window_tokens`.
    pub context_window_tokens: u64,
    /// `max_output_tokens`.
    pub max_output_tokens: u64,
    /// `model_args`.
    pub model_args: Map<String, Value>,
    /// `tool_result_max_chars`.
    pub tool_result_max_chars: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            models: ModelSelection::default(),
            rerank_model: None,
            system_prompt: DEFAULT_SYSTEM_PROMPT.to_owned(),
            prompt_variables: BTreeMap::new(),
            max_rounds: DEFAULT_MAX_ROUNDS,
            knowledge_top_k: DEFAULT_KNOWLEDGE_TOP_K,
            rerank_top_k: DEFAULT_RERANK_TOP_K,
            context_window_tokens: DEFAULT_CONTEXT_WINDOW_TOKENS,
            max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS,
            model_args: Map::new(),
            tool_result_max_chars: DEFAULT_TOOL_RESULT_MAX_CHARS,
        }
    }
}

/// A key of the config that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("runner_config.{key}: {reason}")]
pub struct ConfigError {
    /// The offending key.
    pub key: &'static str,
    /// What was expected, lowercase.
    pub reason: String,
}

fn err(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        reason: reason.into(),
    }
}

/// The values that mean "nothing selected" in selector fields (the host's sentinels).
fn is_sentinel(s: &str) -> bool {
    matches!(s.trim(), "" | "__none__" | "__none")
}

impl AgentConfig {
    /// Parses `config`, the agent's `runner_config`. `null` values count as absent.
    pub fn parse(config: &Map<String, Value>) -> Result<Self, ConfigError> {
        let mut out = Self::default();
        let get = |key: &str| config.get(key).filter(|v| !v.is_null());
        if let Some(v) = get(keys::MODEL) {
            out.models = parse_models(v)?;
        }
        if let Some(v) = get(keys::RERANK_MODEL) {
            let id = v
                .as_str()
                .ok_or_else(|| err(keys::RERANK_MODEL, "expected a model id"))?;
            out.rerank_model = (!is_sentinel(id)).then(|| id.to_owned());
        }
        if let Some(v) = get(keys::KNOWLEDGE_BASES) {
            let ok = v
                .as_array()
                .is_some_and(|ids| ids.iter().all(Value::is_string));
            if !ok {
                return Err(err(
                    keys::KNOWLEDGE_BASES,
                    "expected a list of knowledge base ids",
                ));
            }
        }
        if let Some(v) = get(keys::SYSTEM_PROMPT) {
            v.as_str()
                .ok_or_else(|| err(keys::SYSTEM_PROMPT, "expected text"))?
                .clone_into(&mut out.system_prompt);
        }
        if let Some(v) = get(keys::PROMPT_VARIABLES) {
            out.prompt_variables = parse_variables(v)?;
        }
        if let Some(v) = get(keys::MAX_ROUNDS) {
            out.max_rounds = bounded(keys::MAX_ROUNDS, v, 1, u64::from(MAX_MAX_ROUNDS))?
                .try_into()
                .unwrap_or(MAX_MAX_ROUNDS);
        }
        if let Some(v) = get(keys::KNOWLEDGE_TOP_K) {
            out.knowledge_top_k = bounded(keys::KNOWLEDGE_TOP_K, v, 1, u64::from(MAX_TOP_K))?
                .try_into()
                .unwrap_or(MAX_TOP_K);
        }
        if let Some(v) = get(keys::RERANK_TOP_K) {
            out.rerank_top_k = bounded(keys::RERANK_TOP_K, v, 1, u64::from(MAX_TOP_K))?
                .try_into()
                .unwrap_or(MAX_TOP_K);
        }
        if let Some(v) = get(keys::CONTEXT_WINDOW_TOKENS) {
            out.context_window_tokens = bounded(keys::CONTEXT_WINDOW_TOKENS, v, 256, 10_000_000)?;
        }
        if let Some(v) = get(keys::MAX_OUTPUT_TOKENS) {
            out.max_output_tokens = bounded(keys::MAX_OUTPUT_TOKENS, v, 1, 1_000_000)?;
        }
        if let Some(v) = get(keys::MODEL_ARGS) {
            out.model_args = v
                .as_object()
                .cloned()
                .ok_or_else(|| err(keys::MODEL_ARGS, "expected an object"))?;
        }
        if let Some(v) = get(keys::TOOL_RESULT_MAX_CHARS) {
            out.tool_result_max_chars = bounded(keys::TOOL_RESULT_MAX_CHARS, v, 100, 1_000_000)?
                .try_into()
                .unwrap_or(DEFAULT_TOOL_RESULT_MAX_CHARS);
        }
        if out.max_output_tokens >= out.context_window_tokens {
            return Err(err(
                keys::MAX_OUTPUT_TOKENS,
                format!(
                    "expected less than context_window_tokens ({})",
                    out.context_window_tokens
                ),
            ));
        }
        Ok(out)
    }
}

/// `model`: a plain id, or `{primary, fallbacks}` (the host's `model-fallback-selector`
/// shape, which is also what grants the models). Sentinels and duplicates are dropped.
fn parse_models(v: &Value) -> Result<ModelSelection, ConfigError> {
    let bad = || {
        err(
            keys::MODEL,
            "expected a model id or {\"primary\": id, \"fallbacks\": [ids]}",
        )
    };
    let mut ids: Vec<&str> = Vec::new();
    match v {
        Value::String(id) => ids.push(id),
        Value::Object(obj) => {
            match obj.get("primary") {
                None | Some(Value::Null) => {}
                Some(Value::String(id)) => ids.push(id),
                Some(_) => return Err(bad()),
            }
            match obj.get("fallbacks") {
                None | Some(Value::Null) => {}
                Some(Value::Array(list)) => {
                    for id in list {
                        ids.push(id.as_str().ok_or_else(bad)?);
                    }
                }
                Some(_) => return Err(bad()),
            }
        }
        _ => return Err(bad()),
    }
    let mut out: Vec<String> = Vec::new();
    for id in ids {
        if !is_sentinel(id) && !out.iter().any(|x| x == id) {
            out.push(id.to_owned());
        }
    }
    Ok(ModelSelection(out))
}

fn parse_variables(v: &Value) -> Result<BTreeMap<String, String>, ConfigError> {
    let obj = v.as_object().ok_or_else(|| {
        err(
            keys::PROMPT_VARIABLES,
            "expected an object of names to values",
        )
    })?;
    obj.iter()
        .map(|(name, value)| {
            let text = match value {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => {
                    return Err(err(
                        keys::PROMPT_VARIABLES,
                        format!("{name}: expected text, a number or a boolean"),
                    ));
                }
            };
            Ok((name.clone(), text))
        })
        .collect()
}

/// An integer in `[min, max]` (a whole float such as `8.0` counts: JSON from forms).
fn bounded(key: &'static str, v: &Value, min: u64, max: u64) -> Result<u64, ConfigError> {
    let n = v
        .as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= u64::MAX as f64)
                .map(|f| f as u64)
        })
        .ok_or_else(|| err(key, format!("expected an integer from {min} to {max}")))?;
    if !(min..=max).contains(&n) {
        return Err(err(
            key,
            format!("expected an integer from {min} to {max}, got {n}"),
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<AgentConfig, ConfigError> {
        AgentConfig::parse(v.as_object().unwrap())
    }

    #[test]
    fn an_empty_config_takes_every_default() {
        assert_eq!(parse(json!({})).unwrap(), AgentConfig::default());
        // Null counts as absent, unknown keys are the host's or a newer version's.
        let cfg = parse(json!({"model": null, "timeout": 30, "future_key": [1]})).unwrap();
        assert_eq!(cfg, AgentConfig::default());
    }

    #[test]
    fn models_keep_their_order_without_sentinels_or_duplicates() {
        let cfg = parse(json!({"model": "m1"})).unwrap();
        assert_eq!(cfg.models.0, ["m1"]);
        let cfg =
            parse(json!({"model": {"primary": "m1", "fallbacks": ["m2", "__none__", "m1", "m3"]}}))
                .unwrap();
        assert_eq!(cfg.models.0, ["m1", "m2", "m3"]);
        let cfg = parse(json!({"model": {"fallbacks": ["m2"]}})).unwrap();
        assert_eq!(cfg.models.0, ["m2"]);
        for bad in [
            json!(3),
            json!({"primary": 1}),
            json!({"fallbacks": "m2"}),
            json!({"fallbacks": [1]}),
        ] {
            let e = parse(json!({ "model": bad })).unwrap_err();
            assert_eq!(e.key, keys::MODEL, "{e}");
        }
    }

    #[test]
    fn every_other_key_is_read_and_checked() {
        let cfg = parse(json!({
            "rerank_model": "r1",
            "knowledge_bases": ["kb1"],
            "system_prompt": "Be {{tone}}.",
            "prompt_variables": {"tone": "brief", "n": 3, "on": true},
            "max_rounds": 2,
            "knowledge_top_k": 7.0,
            "rerank_top_k": 2,
            "context_window_tokens": 32768,
            "max_output_tokens": 2048,
            "model_args": {"temperature": 0.2},
            "tool_result_max_chars": 500,
        }))
        .unwrap();
        assert_eq!(cfg.rerank_model.as_deref(), Some("r1"));
        assert_eq!(cfg.system_prompt, "Be {{tone}}.");
        assert_eq!(cfg.prompt_variables["n"], "3");
        assert_eq!(cfg.prompt_variables["on"], "true");
        assert_eq!(
            (cfg.max_rounds, cfg.knowledge_top_k, cfg.rerank_top_k),
            (2, 7, 2)
        );
        assert_eq!(
            (cfg.context_window_tokens, cfg.max_output_tokens),
            (32768, 2048)
        );
        assert_eq!(cfg.model_args["temperature"], 0.2);
        assert_eq!(cfg.tool_result_max_chars, 500);
        assert_eq!(
            parse(json!({"rerank_model": "__none__"}))
                .unwrap()
                .rerank_model,
            None
        );
    }

    #[test]
    fn each_bad_value_names_its_key() {
        for (config, key) in [
            (json!({"rerank_model": 5}), keys::RERANK_MODEL),
            (json!({"knowledge_bases": "kb1"}), keys::KNOWLEDGE_BASES),
            (json!({"knowledge_bases": [1]}), keys::KNOWLEDGE_BASES),
            (json!({"system_prompt": ["x"]}), keys::SYSTEM_PROMPT),
            (
                json!({"prompt_variables": {"a": {"b": 1}}}),
                keys::PROMPT_VARIABLES,
            ),
            (json!({"prompt_variables": "a=b"}), keys::PROMPT_VARIABLES),
            (json!({"max_rounds": 0}), keys::MAX_ROUNDS),
            (json!({"max_rounds": 65}), keys::MAX_ROUNDS),
            (json!({"max_rounds": 2.5}), keys::MAX_ROUNDS),
            (json!({"max_rounds": "8"}), keys::MAX_ROUNDS),
            (json!({"knowledge_top_k": 51}), keys::KNOWLEDGE_TOP_K),
            (json!({"rerank_top_k": -1}), keys::RERANK_TOP_K),
            (
                json!({"context_window_tokens": 10}),
                keys::CONTEXT_WINDOW_TOKENS,
            ),
            (json!({"max_output_tokens": 0}), keys::MAX_OUTPUT_TOKENS),
            (
                json!({"context_window_tokens": 1000, "max_output_tokens": 1000}),
                keys::MAX_OUTPUT_TOKENS,
            ),
            (json!({"model_args": [1]}), keys::MODEL_ARGS),
            (
                json!({"tool_result_max_chars": 5}),
                keys::TOOL_RESULT_MAX_CHARS,
            ),
        ] {
            let e = parse(config.clone()).unwrap_err();
            assert_eq!(e.key, key, "{config}: {e}");
            assert!(
                e.to_string().starts_with(&format!("runner_config.{key}: ")),
                "{e}"
            );
        }
    }
}
