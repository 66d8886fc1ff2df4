//! Switchboard Host API (SPEC §8): what a runner may ask of the host, and every check a call
//! passes before it is served.
//!
//! One concern, two transports. A runner calls the Host API either over its process's stdio
//! (the worker's runner host, `sb_worker::runner`) or over HTTP (`POST /v1/host/{action}`,
//! `sb_gateway::routes::host`). Both establish who is calling and hand the call to the same
//! [`HostApi`] built here, [`ApiGate`] in front of [`ActionDispatcher`], against the same
//! session store and database, so a call is judged identically whichever way it came, and
//! the per-run rate limit and budgets are shared between the two. This crate depends on no
//! role: the worker and the gateway both depend on it.
//!
//! # Validation order
//!
//! The whole pipeline of one call, in the order the code runs it. The first refusal is the
//! answer; nothing after it runs.
//!
//! ```text
//!  transport (not in this crate) — who is calling
//!   stdio  the run is an active run of the calling process      no ─▶ not_found
//!          (sb_worker::runner::host; caller = the process's plugin, with its Connection)
//!   HTTP   bearer token present, body {run_id, params}          no ─▶ 401 / 400
//!          the token is the live run's (digest in the session)  no ─▶ 401 (one answer for all)
//!          (sb_gateway::routes::host; caller = the session's plugin, no Connection)
//!
//!  ApiGate (api_gate) — the session
//!   0. the run is one the caller's Connection hosts now        no ─▶ not_found (as 1)
//!   1. session   the run's session exists                        no ─▶ not_found
//!                (store unreachable ─▶ unavailable; not a snapshot of this run ─▶ internal)
//!   2. identity  the session has a plugin identity, equal to
//!                the caller's                                    no ─▶ unauthorized
//!   2b.          the session's workspace is the Connection's     no ─▶ unauthorized
//!   3. deadline  the session's deadline has not passed           no ─▶ deadline_exceeded
//!
//!  ActionDispatcher (actions) — the action, against the frozen snapshot
//!      action parse  a name of sb_protocol::action::Action       no ─▶ not_found
//!      params        an object (or null)                          no ─▶ invalid_argument
//!   4. authorization API flag / resource id + operation granted  no ─▶ unauthorized
//!   5. scope         conversation / bot / workspace / thread      no ─▶ unauthorized
//!   6. arguments     required keys, types, cursors, limits        no ─▶ invalid_argument
//!   7. budgets       request size, value caps                     no ─▶ payload_too_large
//!                    per-run rate limit (session store)           no ─▶ rate_limited
//!                    per-run model / tool budgets                 no ─▶ budget_exceeded
//!      the action    store or provider call; its own refusals keep their codes
//! ```
//!
//! Steps 0 and 2b only apply to callers with a [`Connection`] (a worker's runner process);
//! they repeat the runner host's own guarantees as defence in depth (SPEC §14). For actions
//! whose scope lives on a stored row (`event_get`, `artifact_*`) step 5 runs after the row is
//! loaded, and only the store can tell a bad cursor; see [`actions`] for both refinements and
//! [`api_gate`] for why the gate's order is the seed host's.
//!
//! # Layout
//! - [`api`]: the boundary a transport calls: the [`HostApi`] trait and its contract, who is
//!   calling ([`CallerIdentity`], over which [`Connection`]), where the answer goes
//!   ([`ApiStream`]), [`HOST_VERSION`] and [`PROTOCOL_VERSION`].
//! - [`api_gate`]: [`ApiGate`], the [`HostApi`] that checks steps 0–3 and the metrics of every
//!   call, in front of a [`Dispatcher`] that serves the gated call.
//! - [`actions`]: [`ActionDispatcher`], the [`Dispatcher`] of steps 4–7 and every action
//!   (history, events, artifacts, state, storage, steering, models, tools, knowledge), with its
//!   [`ActionLimits`].
//! - [`providers`]: clients of the model providers (OpenAI-compatible chat, SSE streams,
//!   rerank) and HTTP tools behind the resource actions, with their [`ProviderOptions`].
//! - [`basic`]: [`BasicHostApi`], the host without providers (nothing granted), usable bare
//!   or behind the gate.
//! - `testing` (feature `test-util`): run-session fixtures for the tests of this crate and of
//!   both transports.
//!
//! The action vocabulary itself (canonical names and seed aliases) is not here but in
//! `sb_protocol::action`, which the runner SDK shares.

pub mod actions;
pub mod api;
pub mod api_gate;
pub mod basic;
pub mod providers;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;

pub use actions::{ActionDispatcher, ActionLimits};
pub use api::{ApiStream, CallerIdentity, Connection, HOST_VERSION, HostApi, PROTOCOL_VERSION};
pub use api_gate::{ApiGate, Dispatcher, GatedCall};
pub use basic::BasicHostApi;
pub use providers::ProviderOptions;
