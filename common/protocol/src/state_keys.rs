//! Deterministic state scope keys, state key rules and value checks (host-behaviour §2, §10).
//!
//! Pure functions shared by the result sink (`state.updated`), the context builder (state
//! snapshot) and the worker's Host API (`state_get/set/delete/list`), so that all three
//! address the same rows.
//!
//! # Scope keys
//!
//! A scope key is `<scope>:v2:<sha256 hex>` where the hash is taken over a canonical JSON
//! object (keys sorted, separators `,` and `:`, non-ASCII kept as is) holding `version: 2`,
//! `scope`, `runner_id`, `binding_identity`, `bot_id`, `workspace_id` and the scope's own
//! parts:
//!
//! | scope | extra parts | required |
//! | --- | --- | --- |
//! | conversation | `conversation_id`, `thread_id` | `conversation_id` |
//! | actor | `actor_type` (default `user`), `actor_id` | `actor_id` |
//! | subject | `subject_type` (default `unknown`), `subject_id` | `subject_id` |
//! | runner | — | — |
//!
//! The encoding is byte-for-byte the seed host's (`json.dumps(sort_keys=True,
//! separators=(',', ':'), ensure_ascii=False)`), so keys computed here equal the seed's for
//! the same inputs. Hashing a structured object (rather than joining with a separator) means
//! no crafted id can make two different identities collide, and including the binding
//! identity isolates two agents bound to the same runner from each other.
//!
//! A missing required part gives **no key**: the scope is then unavailable for the run
//! (the Host API answers "scope key not available"), instead of silently sharing a key.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::context::StateScope;
use crate::error::{ErrorCode, HasErrorCode};
use crate::host::{AgentBinding, AgentEventEnvelope, AuthorizationSnapshot};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Version tag of the scope-key encoding (part of the hashed object and of the key text).
pub const SCOPE_KEY_VERSION: u64 = 2;

/// Longest state key, in characters (the seed's `state_key` column is 255 characters).
pub const MAX_STATE_KEY_CHARS: usize = 255;

/// Default cap on a state value: 256 KiB of UTF-8 JSON (`MAX_VALUE_JSON_BYTES`).
pub const MAX_STATE_VALUE_BYTES: usize = 262_144;

/// Public key aliases: `conversation_id` is stored as `external.conversation_id`
/// (applied on get, set, delete, list prefix and `state.updated`).
pub const STATE_KEY_ALIASES: &[(&str, &str)] = &[("conversation_id", "external.conversation_id")];

/// The conversation-scope key the snapshot seeds with the event's conversation id.
pub const EXTERNAL_CONVERSATION_ID: &str = "external.conversation_id";

/// Every identity a scope key can depend on. Build it with [`StateKeyParts::from_event`]
/// (orchestrator, at run start) or [`StateKeyParts::from_snapshot`] (Host API, from the
/// frozen session); both give the same parts for the same run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StateKeyParts {
    /// Runner id text (`plugin:<author>/<plugin>/<runner>`).
    pub runner_id: String,
    /// The binding identity (see [`binding_identity`]).
    pub binding_identity: String,
    /// Bot of the event.
    pub bot_id: Option<String>,
    /// Workspace of the event.
    pub workspace_id: Option<String>,
    /// Conversation of the event.
    pub conversation_id: Option<String>,
    /// Thread of the event.
    pub thread_id: Option<String>,
    /// Actor type of the event.
    pub actor_type: Option<String>,
    /// Actor id of the event.
    pub actor_id: Option<String>,
    /// Subject type of the event.
    pub subject_type: Option<String>,
    /// Subject id of the event.
    pub subject_id: Option<String>,
}

impl StateKeyParts {
    /// Parts for `event` handled by `binding`.
    #[must_use]
    pub fn from_event(event: &AgentEventEnvelope, binding: &AgentBinding) -> Self {
        Self {
            runner_id: binding.runner_id.to_string(),
            binding_identity: binding_identity(&binding.binding_id),
            bot_id: event.bot_id.clone(),
            workspace_id: Some(event.workspace_id.to_string()),
            conversation_id: event.conversation_id.clone(),
            thread_id: event.thread_id.clone(),
            actor_type: event.actor.as_ref().map(|a| a.actor_type.clone()),
            actor_id: event.actor.as_ref().and_then(|a| a.actor_id.clone()),
            subject_type: event.subject.as_ref().map(|s| s.subject_type.clone()),
            subject_id: event.subject.as_ref().and_then(|s| s.subject_id.clone()),
        }
    }

    /// Parts from a frozen authorization snapshot (what the Host API has at hand).
    #[must_use]
    pub fn from_snapshot(snapshot: &AuthorizationSnapshot) -> Self {
        Self {
            runner_id: snapshot.runner_id.to_string(),
            binding_identity: binding_identity(&snapshot.binding_id),
            bot_id: snapshot.bot_id.clone(),
            workspace_id: Some(snapshot.workspace_id.to_string()),
            conversation_id: snapshot.conversation_id.clone(),
            thread_id: snapshot.thread_id.clone(),
            actor_type: snapshot.actor.as_ref().map(|a| a.actor_type.clone()),
            actor_id: snapshot.actor.as_ref().and_then(|a| a.actor_id.clone()),
            subject_type: snapshot.subject.as_ref().map(|s| s.subject_type.clone()),
            subject_id: snapshot.subject.as_ref().and_then(|s| s.subject_id.clone()),
        }
    }
}

/// The binding identity used for state isolation: the binding id, or `unknown_binding` when
/// it is empty (host-behaviour §2; our bindings always have an id).
#[must_use]
pub fn binding_identity(binding_id: &str) -> String {
    if binding_id.is_empty() {
        "unknown_binding".to_owned()
    } else {
        binding_id.to_owned()
    }
}

fn non_empty(value: Option<&String>) -> Option<&str> {
    value.map(String::as_str).filter(|s| !s.is_empty())
}

fn opt(value: Option<&String>) -> Value {
    value.map_or(Value::Null, |s| Value::String(s.clone()))
}

/// The storage key of one scope, or `None` when the parts lack the identity that scope
/// requires (see the module table).
#[must_use]
pub fn scope_key(scope: StateScope, parts: &StateKeyParts) -> Option<String> {
    let mut object: BTreeMap<&str, Value> = BTreeMap::new();
    object.insert("version", Value::from(SCOPE_KEY_VERSION));
    object.insert("scope", Value::String(scope.as_str().to_owned()));
    object.insert("runner_id", Value::String(parts.runner_id.clone()));
    object.insert(
        "binding_identity",
        Value::String(parts.binding_identity.clone()),
    );
    object.insert("bot_id", opt(parts.bot_id.as_ref()));
    object.insert("workspace_id", opt(parts.workspace_id.as_ref()));
    match scope {
        StateScope::Conversation => {
            let conversation = non_empty(parts.conversation_id.as_ref())?;
            object.insert("conversation_id", Value::String(conversation.to_owned()));
            object.insert("thread_id", opt(parts.thread_id.as_ref()));
        }
        StateScope::Actor => {
            let actor = non_empty(parts.actor_id.as_ref())?;
            let actor_type = non_empty(parts.actor_type.as_ref()).unwrap_or("user");
            object.insert("actor_type", Value::String(actor_type.to_owned()));
            object.insert("actor_id", Value::String(actor.to_owned()));
        }
        StateScope::Subject => {
            let subject = non_empty(parts.subject_id.as_ref())?;
            let subject_type = non_empty(parts.subject_type.as_ref()).unwrap_or("unknown");
            object.insert("subject_type", Value::String(subject_type.to_owned()));
            object.insert("subject_id", Value::String(subject.to_owned()));
        }
        StateScope::Runner => {}
    }
    let canonical = canonical_json(&object);
    let digest = Sha256::digest(canonical.as_bytes());
    Some(format!(
        "{}:v{SCOPE_KEY_VERSION}:{}",
        scope.as_str(),
        hex::encode(digest)
    ))
}

/// The keys of every scope that has one (scopes without their required identity are left
/// out), whatever the state policy says; callers filter by policy.
#[must_use]
pub fn scope_keys(parts: &StateKeyParts) -> BTreeMap<StateScope, String> {
    StateScope::ALL
        .into_iter()
        .filter_map(|scope| scope_key(scope, parts).map(|key| (scope, key)))
        .collect()
}

/// Canonical JSON text of a flat object of scalars: sorted keys (the `BTreeMap` order is
/// byte order, equal to code-point order, which is what Python's `sort_keys` uses), no
/// whitespace, non-ASCII unescaped. Scalar encoding is serde_json's, which escapes exactly
/// what Python's `ensure_ascii=False` escapes (`"`, `\` and control characters, lowercase
/// hex).
fn canonical_json(object: &BTreeMap<&str, Value>) -> String {
    let mut out = String::from("{");
    for (i, (key, value)) in object.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Serializing a str or scalar Value cannot fail.
        let _ = write!(
            out,
            "{}:{}",
            serde_json::to_string(key).unwrap_or_default(),
            serde_json::to_string(value).unwrap_or_default()
        );
    }
    out.push('}');
    out
}

/// Maps accepted public aliases to protocol state keys (`conversation_id` →
/// `external.conversation_id`); other keys are returned unchanged.
#[must_use]
pub fn normalize_state_key(key: &str) -> &str {
    STATE_KEY_ALIASES
        .iter()
        .find(|(alias, _)| *alias == key)
        .map_or(key, |(_, target)| target)
}

/// Why a state key or value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateValidationError {
    /// State is disabled by the binding's policy.
    #[error("state is disabled by binding policy")]
    Disabled,
    /// The scope is not enabled by the binding's policy.
    #[error("scope \"{0}\" is not enabled by binding policy")]
    ScopeNotEnabled(StateScope),
    /// The run lacks the identity the scope needs (e.g. no actor id for `actor`).
    #[error("missing identity for scope \"{0}\"")]
    MissingIdentity(StateScope),
    /// The key is empty.
    #[error("state key must not be empty")]
    EmptyKey,
    /// The key is too long.
    #[error("state key is {chars} characters, the limit is {limit}")]
    KeyTooLong {
        /// Length of the key.
        chars: usize,
        /// The limit.
        limit: usize,
    },
    /// The key contains a control character.
    #[error("state key must not contain control characters")]
    KeyControlChar,
    /// The value is over the size cap.
    #[error("value size {size} bytes exceeds limit {limit} bytes")]
    ValueTooLarge {
        /// Size of the value's JSON text.
        size: usize,
        /// The limit.
        limit: usize,
    },
}

impl HasErrorCode for StateValidationError {
    fn code(&self) -> ErrorCode {
        match self {
            Self::Disabled | Self::ScopeNotEnabled(_) => ErrorCode::Unauthorized,
            Self::MissingIdentity(_)
            | Self::EmptyKey
            | Self::KeyTooLong { .. }
            | Self::KeyControlChar => ErrorCode::InvalidArgument,
            Self::ValueTooLarge { .. } => ErrorCode::PayloadTooLarge,
        }
    }
}

/// Normalizes a state key (aliases) and checks it: non-empty, at most
/// [`MAX_STATE_KEY_CHARS`] characters, no control characters. Returns the normalized key.
pub fn check_state_key(key: &str) -> Result<String, StateValidationError> {
    let key = normalize_state_key(key);
    if key.is_empty() {
        return Err(StateValidationError::EmptyKey);
    }
    let chars = key.chars().count();
    if chars > MAX_STATE_KEY_CHARS {
        return Err(StateValidationError::KeyTooLong {
            chars,
            limit: MAX_STATE_KEY_CHARS,
        });
    }
    if key.chars().any(char::is_control) {
        return Err(StateValidationError::KeyControlChar);
    }
    Ok(key.to_owned())
}

/// Checks a state value's size: the UTF-8 JSON text (non-ASCII unescaped, as the seed
/// measures it) must be at most `limit` bytes. Returns the size.
pub fn check_state_value(value: &Value, limit: usize) -> Result<usize, StateValidationError> {
    // serde_json never escapes non-ASCII, so this is the seed's measure.
    let size = serde_json::to_vec(value).map_or(usize::MAX, |v| v.len());
    if size > limit {
        return Err(StateValidationError::ValueTooLarge { size, limit });
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parts() -> StateKeyParts {
        StateKeyParts {
            runner_id: "plugin:acme/echo/default".into(),
            binding_identity: "agent_a1_plugin:acme/echo/default".into(),
            bot_id: None,
            workspace_id: Some("default".into()),
            conversation_id: Some("c1".into()),
            thread_id: None,
            actor_type: None,
            actor_id: None,
            subject_type: None,
            subject_id: None,
        }
    }

    /// Expected values computed with the seed's Python encoding:
    /// `json.dumps(payload, sort_keys=True, separators=(',', ':'), ensure_ascii=False)`.
    #[test]
    fn keys_match_the_seed_encoding() {
        assert_eq!(
            scope_key(StateScope::Conversation, &parts()).unwrap(),
            "conversation:v2:85420cb9371bed53c27642c02549b20fb0aa7bcaae4f6301dd8c842da02844a7"
        );
        let actor = StateKeyParts {
            bot_id: Some("bot-é".into()),
            actor_id: Some("u\"1\n".into()),
            ..parts()
        };
        assert_eq!(
            scope_key(StateScope::Actor, &actor).unwrap(),
            "actor:v2:e260f252dde70816961e0ac596327f36b1bc83c665e16311dd7531d56aa943da"
        );
    }

    #[test]
    fn keys_are_deterministic_and_isolate_bindings_and_scopes() {
        let a = parts();
        assert_eq!(
            scope_key(StateScope::Runner, &a),
            scope_key(StateScope::Runner, &a.clone())
        );
        let other_binding = StateKeyParts {
            binding_identity: "agent_a2_plugin:acme/echo/default".into(),
            ..parts()
        };
        for scope in [StateScope::Conversation, StateScope::Runner] {
            assert_ne!(
                scope_key(scope, &a),
                scope_key(scope, &other_binding),
                "{scope}"
            );
        }
        let other_runner = StateKeyParts {
            runner_id: "plugin:acme/other/default".into(),
            ..parts()
        };
        assert_ne!(
            scope_key(StateScope::Runner, &a),
            scope_key(StateScope::Runner, &other_runner)
        );
        // the thread is part of the conversation scope
        let threaded = StateKeyParts {
            thread_id: Some("t1".into()),
            ..parts()
        };
        assert_ne!(
            scope_key(StateScope::Conversation, &a),
            scope_key(StateScope::Conversation, &threaded)
        );
        // the runner scope does not depend on the conversation
        let elsewhere = StateKeyParts {
            conversation_id: Some("c2".into()),
            ..parts()
        };
        assert_eq!(
            scope_key(StateScope::Runner, &a),
            scope_key(StateScope::Runner, &elsewhere)
        );
        let key = scope_key(StateScope::Runner, &a).unwrap();
        assert!(key.starts_with("runner:v2:") && key.len() == "runner:v2:".len() + 64);
    }

    #[test]
    fn missing_identity_gives_no_key() {
        let none = StateKeyParts {
            conversation_id: None,
            ..parts()
        };
        assert_eq!(scope_key(StateScope::Conversation, &none), None);
        let empty = StateKeyParts {
            conversation_id: Some(String::new()),
            ..parts()
        };
        assert_eq!(scope_key(StateScope::Conversation, &empty), None);
        assert_eq!(scope_key(StateScope::Actor, &parts()), None);
        assert_eq!(scope_key(StateScope::Subject, &parts()), None);
        let keys = scope_keys(&parts());
        assert_eq!(
            keys.keys().copied().collect::<Vec<_>>(),
            [StateScope::Conversation, StateScope::Runner]
        );
    }

    #[test]
    fn actor_and_subject_type_defaults() {
        let explicit = StateKeyParts {
            actor_type: Some("user".into()),
            actor_id: Some("u1".into()),
            subject_type: Some("unknown".into()),
            subject_id: Some("s1".into()),
            ..parts()
        };
        let defaulted = StateKeyParts {
            actor_type: Some(String::new()),
            actor_id: Some("u1".into()),
            subject_type: None,
            subject_id: Some("s1".into()),
            ..parts()
        };
        assert_eq!(
            scope_key(StateScope::Actor, &explicit),
            scope_key(StateScope::Actor, &defaulted)
        );
        assert_eq!(
            scope_key(StateScope::Subject, &explicit),
            scope_key(StateScope::Subject, &defaulted)
        );
        let bot = StateKeyParts {
            actor_type: Some("bot".into()),
            ..explicit.clone()
        };
        assert_ne!(
            scope_key(StateScope::Actor, &explicit),
            scope_key(StateScope::Actor, &bot)
        );
    }

    #[test]
    fn key_rules_and_alias() {
        assert_eq!(
            normalize_state_key("conversation_id"),
            EXTERNAL_CONVERSATION_ID
        );
        assert_eq!(normalize_state_key("x"), "x");
        assert_eq!(
            check_state_key("conversation_id").unwrap(),
            EXTERNAL_CONVERSATION_ID
        );
        assert_eq!(check_state_key(""), Err(StateValidationError::EmptyKey));
        assert!(check_state_key(&"k".repeat(255)).is_ok());
        assert!(matches!(
            check_state_key(&"k".repeat(256)),
            Err(StateValidationError::KeyTooLong { chars: 256, .. })
        ));
        assert_eq!(
            check_state_key("a\nb"),
            Err(StateValidationError::KeyControlChar)
        );
        assert_eq!(
            StateValidationError::ScopeNotEnabled(StateScope::Runner).to_string(),
            "scope \"runner\" is not enabled by binding policy"
        );
    }

    #[test]
    fn value_cap_counts_utf8_bytes() {
        // "é" is 2 bytes unescaped; the JSON string adds two quotes
        let v = json!("é".repeat(10));
        assert_eq!(check_state_value(&v, 22), Ok(22));
        assert_eq!(
            check_state_value(&v, 21),
            Err(StateValidationError::ValueTooLarge {
                size: 22,
                limit: 21
            })
        );
        let big = json!("x".repeat(MAX_STATE_VALUE_BYTES));
        assert!(check_state_value(&big, MAX_STATE_VALUE_BYTES).is_err());
        assert_eq!(
            StateValidationError::ValueTooLarge { size: 1, limit: 0 }.code(),
            ErrorCode::PayloadTooLarge
        );
    }
}
