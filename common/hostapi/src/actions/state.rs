//! `state_get`, `state_set`, `state_delete`, `state_list`: small scoped JSON values with a
//! compare-and-set revision (host-behaviour §10, §22.2).
//!
//! Checks, in order: the `state` API flag; the frozen state policy (state enabled, scope
//! enabled — an unknown scope name is "not enabled" too); the run has the identity the scope
//! needs (a scope key); key, value and revision arguments; the value cap (256 KiB of UTF-8
//! JSON); the rate limit.
//!
//! Rows are addressed by the deterministic scope keys of [`sb_protocol::state_keys`], computed
//! from the frozen snapshot: the same keys the orchestrator uses for `state.updated` results
//! and the run's state snapshot, so all three address the same rows, and two agents bound to
//! the same runner never share one (the binding identity is part of the key).

use sb_protocol::context::StateScope;
use sb_protocol::error::AgentApiError;
use sb_protocol::state_keys::{
    StateKeyParts, StateValidationError, check_state_key, check_state_value, scope_key,
};
use sb_store::{StateWrite, StoreError};
use serde_json::{Value, json};

use super::params::page_limit;
use super::{Action, ActionDispatcher, Cx, api_not_granted, invalid, store_error, unauthorized};

/// A state key or value refusal, with its protocol code (the one mapping of
/// [`StateValidationError`]); size refusals carry the size and limit as details.
fn refused(error: &StateValidationError) -> AgentApiError {
    let answer = AgentApiError::from_error(error);
    match error {
        StateValidationError::ValueTooLarge { size, limit } => answer
            .with_detail("size", *size)
            .with_detail("limit", *limit),
        _ => answer,
    }
}

/// Normalizes (`conversation_id` → `external.conversation_id`) and checks a state key.
fn state_key(key: &str) -> Result<String, AgentApiError> {
    check_state_key(key).map_err(|e| refused(&e))
}

/// An optional compare-and-set revision: `0` = the key must not exist, `n` = it must be at
/// revision `n`.
fn if_revision(cx: &Cx<'_, '_>) -> Result<Option<i64>, AgentApiError> {
    match cx.p.opt_i64("if_revision")? {
        Some(n) if n < 0 => Err(invalid("if_revision must be >= 0")),
        other => Ok(other),
    }
}

impl ActionDispatcher {
    pub(super) async fn state(
        &self,
        action: Action,
        cx: &Cx<'_, '_>,
    ) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        let api_name = match action {
            Action::StateGet => "state get",
            Action::StateSet => "state set",
            Action::StateDelete => "state delete",
            _ => "state list",
        };
        // 4: the API flag, then the frozen policy for the requested scope.
        if !snap.available_apis.state {
            return Err(api_not_granted(api_name));
        }
        if !snap.state_policy.enable_state {
            return Err(unauthorized("state access is disabled by binding policy"));
        }
        let scope_name = p.req_str("scope")?;
        let scope = scope_name
            .parse::<StateScope>()
            .ok()
            .filter(|s| snap.state_policy.allows(*s))
            .ok_or_else(|| {
                unauthorized(format!(
                    "scope \"{scope_name}\" is not enabled by binding policy"
                ))
            })?;
        // 5: the run must carry the identity of the scope.
        let scope_key = scope_key(scope, &StateKeyParts::from_snapshot(snap)).ok_or_else(|| {
            invalid(format!(
                "scope key not available for scope \"{scope}\": the run has no {}",
                identity_of(scope)
            ))
        })?;

        match action {
            Action::StateGet => {
                let key = state_key(p.req_str("key")?)?;
                self.admit(cx).await?;
                let entry = self
                    .stores
                    .state
                    .get(&scope_key, &key)
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(match entry {
                    Some(e) => json!({ "value": e.value, "revision": e.revision }),
                    None => json!({ "value": null, "revision": 0 }),
                })
            }
            Action::StateSet => {
                let key = state_key(p.req_str("key")?)?;
                if !p.has_key("value") {
                    return Err(invalid("value is required"));
                }
                let value = p.get("value").cloned().unwrap_or(Value::Null);
                let if_revision = if_revision(cx)?;
                // 7: the value cap, measured as the seed does (UTF-8 JSON, non-ASCII unescaped).
                check_state_value(&value, self.limits.state_value_bytes)
                    .map_err(|e| refused(&e))?;
                self.admit(cx).await?;
                let write = StateWrite {
                    scope_key,
                    scope: scope.as_str().to_owned(),
                    key,
                    value,
                    if_revision,
                };
                match self.stores.state.set(write).await {
                    Ok(revision) => Ok(json!({ "success": true, "revision": revision })),
                    Err(e @ StoreError::Conflict(_)) => {
                        Err(store_error(&e).with_detail("if_revision", if_revision))
                    }
                    Err(e) => Err(store_error(&e)),
                }
            }
            Action::StateDelete => {
                let key = state_key(p.req_str("key")?)?;
                let if_revision = if_revision(cx)?;
                self.admit(cx).await?;
                let deleted = self
                    .stores
                    .state
                    .delete(&scope_key, &key, if_revision)
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(json!({ "success": deleted }))
            }
            _ => {
                let prefix = match p.opt_str("prefix")? {
                    Some("") | None => None,
                    Some(prefix) => Some(state_key(prefix)?),
                };
                let cursor = p.opt_str("cursor")?;
                let limit = page_limit(
                    p,
                    "limit",
                    self.limits.state_page_size_default,
                    self.limits.page_size_max,
                )?;
                self.admit(cx).await?;
                let page = self
                    .stores
                    .state
                    .list(&scope_key, prefix.as_deref(), cursor, Some(limit))
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(
                    json!({ "keys": page.items, "has_more": page.has_more, "next_cursor": page.next_cursor }),
                )
            }
        }
    }
}

/// What a scope's key needs, for the error message.
fn identity_of(scope: StateScope) -> &'static str {
    match scope {
        StateScope::Conversation => "conversation",
        StateScope::Actor => "actor id",
        StateScope::Subject => "subject id",
        StateScope::Runner => "runner",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rules_and_codes() {
        assert_eq!(
            state_key("conversation_id").unwrap(),
            "external.conversation_id"
        );
        assert_eq!(state_key("x").unwrap(), "x");
        assert!(state_key(&"k".repeat(255)).is_ok());
        assert_eq!(
            state_key(&"k".repeat(256)).unwrap_err().code,
            "invalid_argument"
        );
        assert_eq!(state_key("a\nb").unwrap_err().code, "invalid_argument");
        let e = refused(&StateValidationError::ValueTooLarge { size: 9, limit: 8 });
        assert_eq!(
            (e.code.as_str(), e.details["size"].as_u64()),
            ("payload_too_large", Some(9))
        );
    }
}
