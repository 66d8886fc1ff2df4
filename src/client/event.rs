//! The bodies the client sends to the gateway and reads back: a user message for
//! `POST /v1/events` ([`NewEvent`]), an event's status ([`EventStatus`]) and the gateway's
//! `{code, message}` error body.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Body of `POST /v1/events` for a user message.
#[derive(Debug, Clone, Serialize)]
pub struct NewEvent {
    event_type: &'static str,
    source: &'static str,
    conversation_id: String,
    actor: Actor,
    input: Input,
    delivery: Delivery,
}

#[derive(Debug, Clone, Serialize)]
struct Actor {
    actor_type: &'static str,
    actor_id: String,
}

#[derive(Debug, Clone, Serialize)]
struct Input {
    text: String,
    contents: Vec<Value>,
    attachments: Vec<Value>,
}

#[derive(Debug, Clone, Serialize)]
struct Delivery {
    surface: &'static str,
    supports_streaming: bool,
}

impl NewEvent {
    /// A `message.received` from the API surface (which streams).
    pub fn message(conversation_id: &str, actor_id: &str, text: &str) -> Self {
        Self {
            event_type: "message.received",
            source: "api",
            conversation_id: conversation_id.to_owned(),
            actor: Actor {
                actor_type: "user",
                actor_id: actor_id.to_owned(),
            },
            input: Input {
                text: text.to_owned(),
                contents: Vec::new(),
                attachments: Vec::new(),
            },
            delivery: Delivery {
                surface: "api",
                supports_streaming: true,
            },
        }
    }
}

/// `202` answer of `POST /v1/events`, and the body of `GET /v1/events/{id}` (extra fields
/// ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct EventStatus {
    /// The event.
    pub event_id: String,
    /// `received`, `dispatched`, `claimed`, `unrouted`, `rejected` (or `scheduled`).
    pub status: String,
    /// The run the event started.
    #[serde(default)]
    pub run_id: Option<String>,
    /// When `claimed`: the active run the event was steered into.
    #[serde(default)]
    pub claimed_by_run_id: Option<String>,
    /// Why it was not routed or was rejected.
    #[serde(default)]
    pub reason: Option<String>,
}

/// `{code, message}` error body.
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorBody {
    pub(crate) code: String,
    #[serde(default)]
    pub(crate) message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_body_matches_the_api() {
        let body = serde_json::to_value(NewEvent::message("c1", "u1", "hello")).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "event_type": "message.received", "source": "api", "conversation_id": "c1",
                "actor": {"actor_type": "user", "actor_id": "u1"},
                "input": {"text": "hello", "contents": [], "attachments": []},
                "delivery": {"surface": "api", "supports_streaming": true}
            })
        );
    }
}
