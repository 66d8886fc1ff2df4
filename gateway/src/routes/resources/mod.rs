//! The workspace resource registry (SPEC §8): `POST/GET /v1/models`, `POST/GET /v1/tools`,
//! `POST/GET /v1/knowledge-bases`, `POST/GET /v1/knowledge-bases/{kb_id}/documents`, and
//! `GET/PATCH/DELETE` of each one (`/v1/models/{id}`, `/v1/tools/{id}`,
//! `/v1/knowledge-bases/{id}`, `/v1/knowledge-bases/{kb_id}/documents/{id}`).
//!
//! # Editing
//!
//! A `PATCH` body holds the fields to change, with the names of the create body; the current
//! registration with the patch on top (top-level keys replace, `null` clears an optional
//! field) is then checked exactly as a create body is (unknown fields, egress policy, secret
//! references, limits) and replaces the registration; the answer is the updated view. A
//! document's text cannot be patched (delete it and add the new text), only its `title`
//! and `metadata`.
//!
//! Nothing caches a registration: the orchestrator's catalog reads the registry for every
//! run it plans, and a worker reads the model or tool at every call, so an edit or a delete
//! applies from the next run (and the next call of a running one).
//!
//! # Deleting what an agent uses
//!
//! A `DELETE` of a model, tool or knowledge base that an agent of the workspace still refers
//! to (its `resource_policy` grants, or, for ids, anywhere in its `runner_config`, e.g. the
//! local agent's `model.primary`) is refused with `409 conflict` naming the agents: a
//! delete would otherwise leave the agent failing at its next run. Renaming a tool that an
//! agent grants by name is refused the same way. Edit or delete the agents first.
//!
//! A document's text is given inline (`text`) or read from an artifact of the workspace
//! (`artifact_id`, e.g. a file a runner produced or an event attached); see
//! [`documents::add_document`] for what an artifact must be.
//!
//! Secrets never pass through here: a model names the environment variable holding its API
//! key (`api_key_env`) and a tool the environment variables of its static headers
//! (`headers_env`), and only workers read the values when they call the provider. A name must
//! be one the operator made available (`secrets.allow`, see `sb_common::secrets`), never the
//! host's own configuration. The views echo those *names* (so an operator can see which
//! variable to set), never a value.
//!
//! URLs pass the deployment's egress policy (`sb_common::egress`) here, so a model or tool
//! pointing at metadata, loopback or private addresses is refused at registration with a
//! clear `400`; workers check again at connect time, on the resolved address.

pub mod documents;
pub mod knowledge;
pub mod models;
mod shared;
pub mod tools;

pub use documents::{
    AddDocument, DocumentView, EditDocument, add_document, delete_document, list_documents,
    update_document,
};
pub use knowledge::{
    CreateKnowledgeBase, KnowledgeBaseView, create_kb, delete_kb, get_kb, list_kbs, update_kb,
};
pub use models::{
    CreateModel, ModelView, create_model, delete_model, get_model, list_models, update_model,
};
pub(crate) use shared::from_body;
pub use shared::{Reference, referrers};
pub use tools::{
    CreateTool, ToolView, create_tool, delete_tool, get_tool, list_tools, update_tool,
};
