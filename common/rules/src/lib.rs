//! Switchboard's domain rules that more than one role applies, as pure functions over data.
//!
//! The gateway refuses at the API what the orchestrator would find ambiguous, and a
//! schedule the gateway stores fires as the orchestrator's scheduler plans it. Both roles
//! need the same rule, and neither may depend on the other (a role crate links only the
//! shared crates), so the rules live here, below both.
//!
//! # Layout
//! - [`bindings`]: which single agent handles an event (scope specificity, event types,
//!   filters; ties are ambiguous, never fanned out), and which two agents conflict.
//! - [`schedules`]: the firing of a due schedule: fire times, the event and its
//!   announcement.

pub mod bindings;
pub mod schedules;
