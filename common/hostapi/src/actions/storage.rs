//! Plugin and workspace binary storage: `storage_get`, `storage_set`, `storage_delete`,
//! `storage_keys` (the canonical names), also served under the seed host's
//! `get_binary_storage`, `set_binary_storage`, `delete_binary_storage`,
//! `get_binary_storage_keys` (host-behaviour §22.2 "Storage").
//!
//! `owner_type` is the resource id of the grant check: `plugin` needs
//! `resources.storage.plugin_storage`, `workspace` needs `workspace_storage`; anything else is
//! not authorized. The owner is derived by the host — the caller's plugin identity, or the
//! run's workspace — never taken from the message: a runner that names another owner is
//! refused. Values are bytes, base64 (standard alphabet, padded) on the wire, at most the
//! configured cap (default 10 MiB) once decoded.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use sb_protocol::error::AgentApiError;
use sb_protocol::manifest::StorageOp;
use sb_store::state::MAX_KEY_CHARS;
use serde_json::{Value, json};

use super::{
    Action, ActionDispatcher, Cx, invalid, not_found, store_error, too_large, unauthorized,
};

/// Extra request bytes a storage write may carry besides its encoded value (key, owner,
/// JSON punctuation).
const STORAGE_REQUEST_OVERHEAD: usize = 64 * 1024;

/// Base64 length of `n` bytes (padded).
fn encoded_len(n: usize) -> usize {
    n.div_ceil(3).saturating_mul(4)
}

fn storage_key(key: &str) -> Result<&str, AgentApiError> {
    let chars = key.chars().count();
    if chars > MAX_KEY_CHARS {
        return Err(invalid(format!(
            "key is {chars} characters, the limit is {MAX_KEY_CHARS}"
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(invalid("key must not contain control characters"));
    }
    Ok(key)
}

impl ActionDispatcher {
    pub(super) async fn storage(
        &self,
        action: Action,
        cx: &Cx<'_, '_>,
    ) -> Result<Value, AgentApiError> {
        let snap = cx.call.snapshot;
        let p = cx.p;
        // 4: the area is the resource; the owner follows from it. A run without any
        // storage grant is refused whatever it asks for.
        let granted = snap.storage();
        if !granted.plugin_storage && !granted.workspace_storage {
            return Err(unauthorized("storage is not authorized for this agent run"));
        }
        let owner_type = p.req_str("owner_type")?;
        let (area, owner) = match owner_type {
            "plugin" => (StorageOp::Plugin, cx.call.caller.plugin_id.clone()),
            "workspace" => (StorageOp::Workspace, snap.workspace_id.to_string()),
            other => {
                return Err(unauthorized(format!(
                    "storage {other} is not authorized for this agent run"
                )));
            }
        };
        if !snap.allows_storage(area) {
            return Err(unauthorized(format!(
                "storage {owner_type} is not authorized for this agent run"
            )));
        }
        // 5: the owner is the run's, whatever the message says.
        if let Some(named) = p.opt_str("owner")? {
            if named != owner {
                return Err(unauthorized(format!(
                    "{owner_type} storage of {named} is not accessible by this run"
                )));
            }
        }
        match action {
            Action::StorageGet => {
                let key = storage_key(p.req_str("key")?)?;
                self.admit(cx).await?;
                let value = self
                    .stores
                    .storage
                    .get(owner_type, &owner, key)
                    .await
                    .map_err(|e| store_error(&e))?;
                match value {
                    Some(bytes) => Ok(json!({ "value_base64": STANDARD.encode(bytes) })),
                    None => Err(not_found(format!("storage with key {key} not found"))),
                }
            }
            Action::StorageSet => {
                let key = storage_key(p.req_str("key")?)?;
                let Some(encoded) = p.get("value_base64") else {
                    return Err(invalid("value_base64 is required"));
                };
                let Some(encoded) = encoded.as_str() else {
                    return Err(invalid("value_base64 must be a string"));
                };
                let max = self.limits.storage_value_bytes;
                // 7 before decoding: a value whose encoding is already too long is refused
                // without decoding it.
                if encoded.len() > encoded_len(max) {
                    let size = encoded.len() / 4 * 3;
                    return Err(too_large(
                        format!("binary storage value exceeds limit ({size} > {max} bytes)"),
                        size,
                        max,
                    ));
                }
                // 6
                let value = STANDARD
                    .decode(encoded)
                    .map_err(|e| invalid(format!("value_base64 is not valid base64: {e}")))?;
                // 7
                if value.len() > max {
                    return Err(too_large(
                        format!(
                            "binary storage value exceeds limit ({} > {max} bytes)",
                            value.len()
                        ),
                        value.len(),
                        max,
                    ));
                }
                let cap = self
                    .limits
                    .max_request_bytes
                    .max(encoded_len(max).saturating_add(STORAGE_REQUEST_OVERHEAD));
                self.admit_with_cap(cx, cap).await?;
                self.stores
                    .storage
                    .set(owner_type, &owner, key, value)
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(json!({}))
            }
            Action::StorageDelete => {
                let key = storage_key(p.req_str("key")?)?;
                self.admit(cx).await?;
                self.stores
                    .storage
                    .delete(owner_type, &owner, key)
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(json!({}))
            }
            _ => {
                self.admit(cx).await?;
                let keys = self
                    .stores
                    .storage
                    .keys(owner_type, &owner)
                    .await
                    .map_err(|e| store_error(&e))?;
                Ok(json!({ "keys": keys }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_lengths() {
        for n in [0usize, 1, 2, 3, 4, 10, 1024] {
            assert_eq!(encoded_len(n), STANDARD.encode(vec![0u8; n]).len(), "{n}");
        }
    }
}
