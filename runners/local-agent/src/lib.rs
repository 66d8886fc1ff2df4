//! The official local-agent runner (`plugin:switchboard/local-agent/default`): a
//! model-backed agent written against the Host API only. It gets nothing the host does not
//! grant the run: its models, tools, knowledge bases, history and state all come through
//! `ctx.resources`, `ctx.context.available_apis` and the Host API calls they allow.
//!
//! For each message it
//! 1. searches every granted knowledge base for the message (`retrieve_knowledge`, top-k
//!    from the config), reranks the hits when a rerank model is granted (`invoke_rerank`),
//!    and puts the chunks, numbered for citation, in the system prompt;
//! 2. pages the conversation's prior turns (`history_page`) into a token budget derived from
//!    the model's context window (`runtime.metadata.model_context_window_tokens`), and, when
//!    they do not fit, summarises the oldest into a compaction checkpoint in conversation
//!    state (`runner.compaction.checkpoint`) that later runs start from;
//! 3. runs a bounded tool loop: `invoke_llm_stream` (every text chunk streamed to the user as
//!    a `message.delta` as the model produces it), each tool call executed with `call_tool`
//!    under a run-unique `call_id` and its result fed back, until the model answers without
//!    tools or `max_rounds` model calls were made; a retryable provider failure moves to the
//!    next model of the configured fallback list;
//! 4. absorbs the user's follow-up messages (steering) between rounds;
//! 5. ends with `message.completed` and `run.completed` carrying the summed model usage, or a
//!    `run.failed` whose `runner.*` code says what stopped it (a used-up budget is
//!    `runner.budget_exceeded`, never a silent success).
//!
//! # Layout
//! - `config`: the `runner_config` keys, their defaults and checks (pure).
//! - `plan`: model order and fallback, round bound, tool calls, usage, failure codes (pure).
//! - `prompt`: system prompt variables, knowledge context, message assembly (pure).
//! - `history`: token estimates, trimming to the budget, the compaction checkpoint (pure).
//! - `agent`: the I/O loop over the Host API (thin).
//! - `src/main.rs`: the `local-agent` binary the manifest starts.

mod agent;
pub mod config;
pub mod history;
pub mod plan;
pub mod prompt;

use sb_runner::{EmitError, Emitter, Run, RunError, Runner};
use serde_json::{Map, Value, json};

use crate::agent::{Agent, Stop};
use crate::plan::{Failure, Usage};

/// Runner id of the local agent.
pub const RUNNER_ID: &str = "plugin:switchboard/local-agent/default";

/// The plugin manifest (`runners/local-agent/manifest.toml`), for hosts that write the
/// plugin directory themselves (the copy built into `switchboard`).
pub const MANIFEST_TOML: &str = include_str!("../manifest.toml");

/// The local-agent runner.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalAgent;

impl Runner for LocalAgent {
    fn run(&self, run: &Run, out: &Emitter) -> Result<(), RunError> {
        let mut agent = match Agent::new(run, out) {
            Ok(agent) => agent,
            Err(failure) => return fail(out, &failure, &Usage::default()),
        };
        match agent.execute() {
            Ok(()) => Ok(()),
            Err(Stop::Fail(failure)) => fail(out, &failure, agent.usage()),
            // The host ended the run (a cancel, a deadline): nothing more to say.
            Err(Stop::Emit(EmitError::Finished)) => Ok(()),
            Err(Stop::Emit(e)) => Err(e.into()),
        }
    }
}

/// Writes `run.failed` with the usage so far (the ledger records what a failed run cost).
fn fail(out: &Emitter, failure: &Failure, usage: &Usage) -> Result<(), RunError> {
    let mut envelope = Map::new();
    envelope.insert("type".into(), json!("run.failed"));
    envelope.insert(
        "data".into(),
        json!({"code": failure.code, "error": failure.message, "retryable": failure.retryable}),
    );
    envelope.insert("usage".into(), Value::Object(usage.to_map()));
    match out.raw(Value::Object(envelope)) {
        Ok(()) | Err(EmitError::Finished) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Serves the local agent on stdin/stdout until the host says `shutdown` or closes stdin.
/// Blocks the calling thread.
pub fn serve() -> std::io::Result<()> {
    sb_runner::serve(LocalAgent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{AgentConfig, keys};

    fn schema() -> Vec<Value> {
        let manifest: toml::Value = toml::from_str(MANIFEST_TOML).expect("the manifest parses");
        let manifest = serde_json::to_value(manifest).expect("as JSON");
        manifest["runners"][0]["config_schema"]
            .as_array()
            .expect("a config schema")
            .clone()
    }

    #[test]
    fn the_manifest_describes_every_config_key_once() {
        let names: Vec<String> = schema()
            .iter()
            .map(|f| f["name"].as_str().expect("a name").to_owned())
            .collect();
        assert_eq!(names, keys::ALL);
        for field in schema() {
            let text = field["description"]["en_US"].as_str().unwrap_or_default();
            assert!(!text.is_empty(), "{field}");
        }
    }

    #[test]
    fn the_schema_defaults_are_the_parser_defaults() {
        let mut config = Map::new();
        for field in schema() {
            if let Some(default) = field.get("default") {
                let name = field["name"].as_str().unwrap();
                if name != keys::TIMEOUT {
                    config.insert(name.to_owned(), default.clone());
                }
            }
        }
        assert_eq!(AgentConfig::parse(&config).unwrap(), AgentConfig::default());
    }

    #[test]
    fn the_manifest_declares_what_the_loop_uses() {
        let manifest: toml::Value = toml::from_str(MANIFEST_TOML).unwrap();
        let manifest = serde_json::to_value(manifest).unwrap();
        let runner = &manifest["runners"][0];
        let id = format!(
            "plugin:{}/{}/{}",
            manifest["plugin"]["author"].as_str().unwrap(),
            manifest["plugin"]["name"].as_str().unwrap(),
            runner["name"].as_str().unwrap()
        );
        assert_eq!(id, RUNNER_ID);
        for capability in [
            "streaming",
            "tool_calling",
            "knowledge_retrieval",
            "steering",
        ] {
            assert_eq!(runner["capabilities"][capability], true, "{capability}");
        }
        assert_eq!(
            runner["permissions"]["models"],
            json!(["invoke", "stream", "rerank"])
        );
        assert_eq!(runner["permissions"]["history"], json!(["page"]));
    }
}
