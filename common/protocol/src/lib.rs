//! Switchboard Protocol v1: the plain data types that cross process boundaries.
//!
//! No I/O and no async runtime live here, so runner SDKs and clients can depend on this crate
//! without pulling in the host. JSON field names follow PROTOCOL_V1 exactly.
//!
//! # Layout
//! - [`action`]: the Host API action vocabulary ([`action::Action`]): canonical wire names
//!   and the seed aliases, in one table.
//! - [`ids`]: host-generated identifiers (newtypes).
//! - [`error`]: the closed [`error::ErrorCode`] set, its HTTP and message-disposition mappings,
//!   and the runner-visible [`error::AgentApiError`].
//! - [`manifest`]: runner discovery: manifest, capabilities, permissions, runner ids.
//! - [`content`]: message content blocks (text, image, reasoning, tool call, tool result).
//! - [`context`]: `AgentRunContext` and everything nested in it, `AgentResources`.
//! - [`result`]: the `AgentRunResult` envelope, typed payloads and the strict/lenient classifier.
//! - [`proxy`]: data shapes returned by the Host API (transcript, events, artifacts).
//! - [`host`]: host-internal models (event envelope, agent config, binding, policies, descriptor,
//!   authorization snapshot).
//! - [`wire`]: newline-delimited JSON messages between a worker and a runner process.
//! - [`state_keys`]: deterministic state scope keys and the state key/value rules (host-behaviour §2, §10).
//! - [`messages`]: bus message bodies (`switchboard.event/1`, `switchboard.job/1`, …).

pub mod action;
pub mod content;
pub mod context;
pub mod error;
pub mod host;
pub mod ids;
pub mod manifest;
pub mod messages;
pub mod proxy;
pub mod result;
pub mod state_keys;
pub mod wire;
