//! Model, tool, knowledge, prompt and config-file actions.
//!
//! The grant check is the real one (step 4: the resource id and operation must be in the
//! frozen snapshot, with the seed's wording), so what a run may *not* do is already final:
//! a run holding no grant of the kind for the operation is refused whatever its arguments;
//! otherwise the id must be given and granted.
//!
//! This worker has no model, tool or knowledge provider, no pipeline prompt and no config
//! files yet, so a granted call answers `not_found` for the resource — the host really has
//! nothing by that id to offer — after the usual argument checks and admission. No budget is
//! consumed: nothing was invoked.

use sb_protocol::error::AgentApiError;
use sb_protocol::manifest::{FileOp, KnowledgeBaseOp, ModelOp, ToolOp};
use serde_json::Value;

use super::params::Params;
use super::{Action, ActionDispatcher, Cx, api_not_granted, invalid, not_found, unauthorized};

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
            Action::InvokeLlm | Action::InvokeLlmStream | Action::InvokeRerank => {
                let (op, names): (ModelOp, &[&str]) = match action {
                    Action::InvokeLlm => (ModelOp::Invoke, &["llm_model_uuid", "model_id"]),
                    Action::InvokeLlmStream => (ModelOp::Stream, &["llm_model_uuid", "model_id"]),
                    _ => (ModelOp::Rerank, &["rerank_model_uuid", "model_id"]),
                };
                let any = res.models.iter().any(|m| m.operations.contains(&op));
                let model = granted_id(p, names, ("model", op.as_str()), any, |id| {
                    snap.allows_model(id, op)
                })?;
                if op == ModelOp::Rerank {
                    p.req_str("query")?;
                    if !matches!(p.get("documents"), Some(Value::Array(_))) {
                        return Err(invalid("documents must be a list"));
                    }
                    format!("rerank model with uuid {model} not found")
                } else {
                    match p.get("messages") {
                        Some(Value::Array(_)) => {}
                        Some(_) => return Err(invalid("messages must be a list")),
                        None => return Err(invalid("messages is required")),
                    }
                    format!("llm model with llm_model_uuid {model} not found")
                }
            }
            Action::GetToolDetail | Action::CallTool => {
                let op = if action == Action::CallTool {
                    ToolOp::Call
                } else {
                    ToolOp::Detail
                };
                let any = res.tools.iter().any(|t| t.operations.contains(&op));
                let tool = granted_id(p, &["tool_name"], ("tool", op.as_str()), any, |id| {
                    snap.allows_tool(id, op)
                })?;
                if action == Action::CallTool && !p.has_key("parameters") {
                    return Err(invalid(
                        "parameters is required for agent runner tool calls",
                    ));
                }
                format!("tool {tool} not found")
            }
            Action::RetrieveKnowledge => {
                let op = KnowledgeBaseOp::Retrieve;
                let any = res
                    .knowledge_bases
                    .iter()
                    .any(|k| k.operations.contains(&op));
                let kb = granted_id(p, &["kb_id"], ("knowledge_base", op.as_str()), any, |id| {
                    snap.allows_knowledge_base(id, op)
                })?;
                p.req_str("query_text")?;
                format!("knowledge base {kb} not found")
            }
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
}
