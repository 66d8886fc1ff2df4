//! Cross-module protocol tests: PROTOCOL_V1 examples, full context round-trip, the result
//! classifier's rules one by one.

use base64::Engine as _;
use sb_protocol::context::AgentRunContext;
use sb_protocol::ids::{RunId, WorkspaceId};
use sb_protocol::messages::{self, RunJob};
use sb_protocol::result::{
    AgentRunResult, Classified, ResultLimits, ResultPayload, ResultType, TRUNCATION_MARKER,
    classify, json_size,
};
use serde_json::{Value, json};

fn limits() -> ResultLimits {
    ResultLimits::default()
}

fn expect_valid(raw: &Value) -> sb_protocol::result::TypedResult {
    match classify(raw, &limits()) {
        Classified::Valid(t) => t,
        other => panic!("expected valid for {raw}, got {other:?}"),
    }
}

fn expect_dropped(raw: &Value) -> String {
    match classify(raw, &limits()) {
        Classified::Dropped { reason } => reason,
        other => panic!("expected dropped for {raw}, got {other:?}"),
    }
}

fn expect_protocol_error(raw: &Value, l: &ResultLimits) -> String {
    match classify(raw, l) {
        Classified::ProtocolError { reason } => reason,
        other => panic!("expected protocol error for {raw}, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// PROTOCOL_V1 examples
// ---------------------------------------------------------------------------------------

#[test]
fn protocol_v1_section_7_5_examples_roundtrip() {
    let examples = [
        (
            json!({ "type": "message.delta", "data": { "chunk": { "role": "assistant", "content": "hel" } } }),
            ResultType::MessageDelta,
        ),
        (
            json!({ "type": "message.completed", "data": { "message": { "role": "assistant", "content": "hello" } } }),
            ResultType::MessageCompleted,
        ),
        (
            json!({ "type": "state.updated", "data": { "scope": "conversation", "key": "external.session_id", "value": "abc" } }),
            ResultType::StateUpdated,
        ),
        (
            json!({ "type": "action.requested", "data": { "action": "message.edit", "target": {"message_id": "..."}, "payload": {"text": "..."} } }),
            ResultType::ActionRequested,
        ),
        // §9
        (
            json!({ "type": "run.failed", "data": { "code": "runner.error", "error": "failed to call external agent", "retryable": false } }),
            ResultType::RunFailed,
        ),
    ];
    for (raw, t) in examples {
        let typed = expect_valid(&raw);
        assert_eq!(typed.result_type(), t);
        assert_eq!(typed.to_json(), raw, "round-trip of {t}");
        // and through the envelope type
        let env: AgentRunResult = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(serde_json::to_value(&env).unwrap(), raw);
        assert_eq!(env.classify(&limits()), Classified::Valid(typed));
    }
}

#[test]
fn every_strict_type_roundtrips_fully_populated() {
    let msg = json!({
        "role": "assistant",
        "content": [
            {"type": "reasoning", "text": "r"},
            {"type": "text", "text": "t"},
            {"type": "image", "base64": "aGk=", "mime_type": "image/png"},
            {"type": "tool_call", "id": "c1", "name": "n", "arguments": {"a": 1}},
            {"type": "tool_result", "tool_call_id": "c1", "content": "ok", "is_error": true}
        ],
        "name": "bot",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "n", "arguments": "{\"a\":1}"}}],
        "artifact_refs": [{"artifact_id": "a1", "artifact_type": "image"}]
    });
    let cases = [
        json!({"run_id": "r", "type": "message.delta", "sequence": 1, "timestamp": 5,
               "usage": {"total_tokens": 3},
               "data": {"chunk": {"role": "assistant", "content": "x", "msg_sequence": 2, "is_final": true}}}),
        json!({"type": "message.completed", "data": {"message": msg.clone()}}),
        json!({"type": "artifact.created", "data": {
            "artifact_type": "file", "artifact_id": "a", "mime_type": "text/plain", "name": "a.txt",
            "size_bytes": 5, "sha256": "00", "metadata": {"k": "v"}, "content_base64": "aGVsbG8="}}),
        json!({"type": "state.updated", "data": {"scope": "runner", "key": "k", "value": {"nested": [1, null]}}}),
        json!({"type": "state.updated", "data": {"scope": "actor", "key": "k", "value": null}}),
        json!({"type": "action.requested", "data": {"action": "message.react"}}),
        json!({"type": "run.completed", "data": {"finish_reason": "length", "message": msg}}),
        json!({"type": "run.completed", "data": {"finish_reason": "stop"}}),
        json!({"type": "run.failed", "data": {"code": "cancelled", "error": "stopped", "retryable": true}}),
    ];
    for raw in cases {
        let typed = expect_valid(&raw);
        assert_eq!(typed.to_json(), raw);
    }
}

#[test]
fn run_completed_message_counts_as_final_message() {
    let t = expect_valid(
        &json!({"type": "run.completed", "data": {"message": {"role": "assistant", "content": "bye"}}}),
    );
    assert_eq!(t.payload.final_message().unwrap().text(), "bye");
    assert!(t.is_terminal());
    // null message means none
    let t = expect_valid(&json!({"type": "run.completed", "data": {"message": null}}));
    let ResultPayload::RunCompleted(rc) = &t.payload else {
        panic!()
    };
    assert!(rc.message.is_none());
}

// ---------------------------------------------------------------------------------------
// Strict payload rejection, per type
// ---------------------------------------------------------------------------------------

#[test]
fn invalid_strict_payloads_are_dropped() {
    let cases: Vec<(&str, Value)> = vec![
        // message.delta
        (
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": "x"}, "extra": 1}),
        ),
        (
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": "x", "mood": "ok"}}),
        ),
        (
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": 5}}),
        ),
        (
            "message.delta",
            json!({"chunk": {"role": "assistant", "content": [{"type": "text"}]}}),
        ),
        ("message.delta", json!({"chunk": "just text"})),
        // message.completed
        (
            "message.completed",
            json!({"message": {"content": "no role"}}),
        ),
        (
            "message.completed",
            json!({"message": {"role": "assistant", "content": "x", "x": 1}}),
        ),
        (
            "message.completed",
            json!({"message": {"role": "assistant", "content": [{"type": "video", "url": "u"}]}}),
        ),
        (
            "message.completed",
            json!({"message": {"role": "assistant", "content": "x"}, "final": true}),
        ),
        (
            "message.completed",
            json!({"message": {"role": "assistant", "tool_calls": [{"id": "1"}]}}),
        ),
        // artifact.created
        ("artifact.created", json!({"name": "no type"})),
        ("artifact.created", json!({"artifact_type": ""})),
        (
            "artifact.created",
            json!({"artifact_type": "file", "size_bytes": -1}),
        ),
        (
            "artifact.created",
            json!({"artifact_type": "file", "size_bytes": "5"}),
        ),
        (
            "artifact.created",
            json!({"artifact_type": "file", "metadata": "m"}),
        ),
        (
            "artifact.created",
            json!({"artifact_type": "file", "url": "https://x"}),
        ),
        // state.updated
        (
            "state.updated",
            json!({"scope": "global", "key": "k", "value": 1}),
        ),
        (
            "state.updated",
            json!({"scope": "conversation", "value": 1}),
        ),
        (
            "state.updated",
            json!({"scope": "conversation", "key": "k"}),
        ),
        (
            "state.updated",
            json!({"scope": "conversation", "key": "", "value": 1}),
        ),
        (
            "state.updated",
            json!({"scope": "conversation", "key": 7, "value": 1}),
        ),
        (
            "state.updated",
            json!({"scope": "conversation", "key": "k", "value": 1, "ttl": 5}),
        ),
        // action.requested
        ("action.requested", json!({"target": {}})),
        ("action.requested", json!({"action": ""})),
        ("action.requested", json!({"action": "a", "target": "t"})),
        ("action.requested", json!({"action": "a", "payload": [1]})),
        ("action.requested", json!({"action": "a", "execute": true})),
        // run.completed
        ("run.completed", json!({"finish_reason": 1})),
        (
            "run.completed",
            json!({"finish_reason": "stop", "usage": {}}),
        ),
        (
            "run.completed",
            json!({"message": {"role": "assistant", "content": "x", "y": 1}}),
        ),
        // run.failed
        ("run.failed", json!({"code": "runner.error"})),
        ("run.failed", json!({"error": "e", "retryable": "no"})),
        ("run.failed", json!({"error": "e", "code": 500})),
        ("run.failed", json!({"error": "e", "details": {}})),
    ];
    for (t, data) in cases {
        let raw = json!({"type": t, "data": data});
        let reason = expect_dropped(&raw);
        assert!(
            reason.starts_with(&format!("invalid {t} payload")),
            "{reason}"
        );
    }
}

#[test]
fn malformed_envelopes_of_strict_types_are_dropped() {
    for raw in [
        json!({"type": "run.completed", "data": "x"}),
        json!({"type": "run.completed", "data": [1]}),
        json!({"type": "run.completed", "data": {}, "sequence": "1"}),
        json!({"type": "run.completed", "data": {}, "sequence": -1}),
        json!({"type": "run.completed", "data": {}, "timestamp": 1.5}),
        json!({"type": "run.completed", "data": {}, "run_id": 5}),
        json!({"type": "run.completed", "data": {}, "usage": "lots"}),
    ] {
        expect_dropped(&raw);
    }
    // missing data on a type whose fields all have defaults is fine
    expect_valid(&json!({"type": "run.completed"}));
    // ... and on one with required fields it is an invalid payload
    expect_dropped(&json!({"type": "state.updated"}));
}

// ---------------------------------------------------------------------------------------
// Type rules
// ---------------------------------------------------------------------------------------

#[test]
fn unknown_type_is_dropped() {
    let reason = expect_dropped(&json!({"type": "message.edited", "data": {"anything": true}}));
    assert!(reason.contains("message.edited"), "{reason}");
    // even with junk data
    expect_dropped(&json!({"type": "future.thing", "data": 5}));
}

#[test]
fn missing_type_is_a_protocol_error() {
    for raw in [
        json!({"data": {"chunk": {"content": "x"}}}),
        json!({"type": "", "data": {}}),
        json!({"type": null}),
        json!({"type": 3}),
    ] {
        let reason = expect_protocol_error(&raw, &limits());
        assert_eq!(reason, "missing result type");
    }
    expect_protocol_error(&json!("message.delta"), &limits());
    expect_protocol_error(&json!([{"type": "run.completed"}]), &limits());
}

#[test]
fn empty_chunk_or_message_is_a_protocol_error() {
    for data in [
        json!({}),
        json!({"chunk": null}),
        json!({"chunk": {}}),
        json!({"chunk": ""}),
    ] {
        let reason =
            expect_protocol_error(&json!({"type": "message.delta", "data": data}), &limits());
        assert_eq!(reason, "message.delta missing chunk data");
    }
    for data in [
        json!({}),
        json!({"message": null}),
        json!({"message": {}}),
        json!({"message": []}),
    ] {
        let reason = expect_protocol_error(
            &json!({"type": "message.completed", "data": data}),
            &limits(),
        );
        assert_eq!(reason, "message.completed missing message data");
    }
    expect_protocol_error(&json!({"type": "message.delta"}), &limits());
    expect_protocol_error(
        &json!({"type": "run.completed", "data": {"message": {}}}),
        &limits(),
    );
}

#[test]
fn tool_call_telemetry_is_lenient() {
    for data in [
        json!("junk"),
        json!(42),
        json!(null),
        json!({"tool_call_id": 5, "tool_name": ["x"], "parameters": "p", "extra": true}),
        json!({"tool_call_id": "c1", "tool_name": "search", "parameters": {"q": "x"}}),
    ] {
        for t in ["tool.call.started", "tool.call.completed"] {
            let raw = json!({"type": t, "data": data, "sequence": "not a number"});
            match classify(&raw, &limits()) {
                Classified::Telemetry(tel) => {
                    assert_eq!(tel.result_type.as_str(), t);
                    assert_eq!(tel.data, data);
                    assert_eq!(tel.sequence, None);
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let raw = json!({"type": "tool.call.completed", "run_id": "r",
                     "data": {"tool_call_id": "c1", "tool_name": "search", "result": null, "error": "boom"}});
    let Classified::Telemetry(tel) = classify(&raw, &limits()) else {
        panic!()
    };
    assert_eq!(
        (tel.tool_call_id(), tel.tool_name(), tel.error()),
        (Some("c1"), Some("search"), Some("boom"))
    );
    assert_eq!(serde_json::to_value(tel.to_result()).unwrap(), raw);
    // missing data entirely
    let Classified::Telemetry(tel) = classify(&json!({"type": "tool.call.started"}), &limits())
    else {
        panic!()
    };
    assert_eq!(tel.tool_call_id(), None);
}

// ---------------------------------------------------------------------------------------
// Size rules
// ---------------------------------------------------------------------------------------

#[test]
fn oversize_message_is_truncated() {
    let big = "é".repeat(600_000); // 1.2 MB of UTF-8
    for (t, field) in [
        ("message.delta", "chunk"),
        ("message.completed", "message"),
        ("run.completed", "message"),
    ] {
        let raw = json!({"type": t, "data": {field: {"role": "assistant", "content": big}}});
        assert!(json_size(&raw) > limits().max_result_bytes);
        let typed = expect_valid(&raw);
        let text = match &typed.payload {
            ResultPayload::MessageDelta(d) => d.chunk.text(),
            p => p.final_message().unwrap().text(),
        };
        assert!(text.ends_with(TRUNCATION_MARKER), "{t}");
        assert_eq!(
            text.chars().count(),
            10_000 + TRUNCATION_MARKER.len(),
            "{t}"
        );
    }
}

#[test]
fn oversize_result_that_cannot_be_truncated_is_a_protocol_error() {
    let big = "x".repeat(1_100_000);
    for raw in [
        json!({"type": "state.updated", "data": {"scope": "runner", "key": "k", "value": big}}),
        json!({"type": "message.completed", "data": {"message": {"role": "assistant",
               "content": [{"type": "text", "text": big}]}}}),
        json!({"type": "run.failed", "data": {"error": big}}),
    ] {
        let reason = expect_protocol_error(&raw, &limits());
        assert!(reason.contains("exceeds limit 1048576 bytes"), "{reason}");
    }
    // oversize telemetry is just dropped
    let raw = json!({"type": "tool.call.completed", "data": {"result": {"out": big}}});
    expect_dropped(&raw);
}

#[test]
fn size_limit_boundary() {
    let raw = json!({"type": "run.failed", "data": {"error": "e".repeat(100)}});
    let size = json_size(&raw);
    let at = ResultLimits {
        max_result_bytes: size,
        ..limits()
    };
    assert!(matches!(classify(&raw, &at), Classified::Valid(_)));
    let below = ResultLimits {
        max_result_bytes: size - 1,
        ..limits()
    };
    expect_protocol_error(&raw, &below);
}

#[test]
fn inline_artifact_limits() {
    let b64 = base64::engine::general_purpose::STANDARD;
    let roomy = ResultLimits {
        max_result_bytes: 8 * 1024 * 1024,
        ..limits()
    };

    let exactly = b64.encode(vec![7u8; 1_048_576]);
    let raw = json!({"type": "artifact.created", "data": {"artifact_type": "file", "content_base64": exactly}});
    let Classified::Valid(t) = classify(&raw, &roomy) else {
        panic!()
    };
    let ResultPayload::ArtifactCreated(a) = &t.payload else {
        panic!()
    };
    assert_eq!(a.decode_content().unwrap().unwrap().len(), 1_048_576);

    let over = b64.encode(vec![7u8; 1_048_577]);
    let raw = json!({"type": "artifact.created", "data": {"artifact_type": "file", "content_base64": over}});
    let reason = expect_protocol_error(&raw, &roomy);
    assert_eq!(
        reason,
        "artifact.created content size 1048577 bytes exceeds limit 1048576 bytes"
    );
    // with default limits it is refused too (by the artifact rule, checked first)
    let reason = expect_protocol_error(&raw, &limits());
    assert!(
        reason.starts_with("artifact.created content size"),
        "{reason}"
    );

    for bad in ["not base64!", "aGVsbG8", "aGVs bG8="] {
        let raw = json!({"type": "artifact.created", "data": {"artifact_type": "file", "content_base64": bad}});
        let reason = expect_protocol_error(&raw, &limits());
        assert!(
            reason.starts_with("artifact.created invalid base64 content"),
            "{reason}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Context
// ---------------------------------------------------------------------------------------

fn full_context(run_id: RunId) -> Value {
    json!({
        "run_id": run_id.to_string(),
        "trigger": {"type": "message.received", "source": "api", "timestamp": 1_700_000_000},
        "event": {
            "event_id": "0190c1a2-0000-7000-8000-000000000001",
            "event_type": "message.received",
            "event_time": 1_700_000_000,
            "source": "api",
            "source_event_type": "im.message",
            "raw_ref": {"ref_type": "artifact", "ref_id": "raw-1", "mime_type": "application/json",
                        "size_bytes": 2048, "metadata": {"platform": "x"}},
            "data": {"message_id": "m1"}
        },
        "conversation": {
            "conversation_id": "c1", "thread_id": "t1", "launcher_type": "person",
            "launcher_id": "l1", "sender_id": "u1", "bot_id": "b1", "workspace_id": "default",
            "session_id": "person_l1"
        },
        "actor": {"actor_type": "user", "actor_id": "u1", "actor_name": "Ann", "metadata": {"lang": "en"}},
        "subject": {"subject_type": "message", "subject_id": "m1", "data": {"len": 5}},
        "input": {
            "text": "hello",
            "contents": [
                {"type": "text", "text": "hello"},
                {"type": "image", "url": "https://x/y.png", "detail": "low"}
            ],
            "attachments": [{"artifact_id": "a1", "artifact_type": "image", "source": "url",
                             "url": "https://x/y.png", "mime_type": "image/png"}]
        },
        "delivery": {
            "surface": "api", "reply_target": {"conversation_id": "c1"},
            "supports_streaming": true, "supports_edit": false, "supports_reaction": true,
            "max_message_size": 4096, "platform_capabilities": {"markdown": true}
        },
        "resources": {
            "models": [{"model_id": "m1", "model_type": "llm", "provider": "openai",
                        "operations": ["invoke", "stream"]}],
            "tools": [{"tool_name": "search", "tool_type": "http", "description": "web",
                       "operations": ["detail", "call"]}],
            "knowledge_bases": [{"kb_id": "k1", "kb_name": "Docs", "kb_type": "fts",
                                 "operations": ["list", "retrieve"]}],
            "skills": [{"skill_name": "s1", "display_name": "Skill", "description": null}],
            "files": [{"file_id": "f1", "file_name": "a.pdf", "mime_type": "application/pdf",
                       "source": "config", "operations": ["config"]}],
            "storage": {"plugin_storage": true, "workspace_storage": false},
            "platform_capabilities": {}
        },
        "context": {
            "conversation_id": "c1", "thread_id": "t1", "latest_cursor": "42", "event_seq": 7,
            "transcript_seq": 42, "has_history_before": true,
            "inline_policy": {"mode": "current_event", "delivered_count": 0, "source_total_count": null,
                              "messages_complete": false, "reason": "current_event_only"},
            "available_apis": {"history_page": true, "history_search": true, "event_get": true,
                               "event_page": true, "artifact_metadata": true, "artifact_read": true,
                               "state": true, "storage": true, "steering_pull": true, "prompt_get": false}
        },
        "state": {"conversation": {"external.session_id": "abc"}, "actor": {}, "subject": {},
                  "runner": {"n": 1}},
        "runtime": {"langbot_version": "switchboard/0.1.0", "trace_id": run_id.to_string(),
                    "deadline_at": 1_700_000_300.5,
                    "metadata": {"bot_id": "b1", "workspace_id": "default", "streaming_supported": true}},
        "config": {"prompt": [{"role": "system", "content": "be nice"}], "timeout": 300},
        "adapter": {"extra": {"params": {"k": "v"}}},
        "metadata": {"origin": "test"}
    })
}

#[test]
fn full_context_roundtrips() {
    let run_id = RunId::new();
    let raw = full_context(run_id);
    let ctx: AgentRunContext = serde_json::from_value(raw.clone()).unwrap();
    assert_eq!(ctx.run_id, run_id);
    assert_eq!(serde_json::to_value(&ctx).unwrap(), raw);

    // and inside a job on the bus
    let job = RunJob::new(
        WorkspaceId::default_workspace(),
        "plugin:acme/echo/default".parse().unwrap(),
        "default",
        ctx.clone(),
    );
    assert_eq!(job.run_id, run_id);
    assert_eq!(job.deadline_at_ms, Some(1_700_000_300_500));
    let bytes = messages::encode(&job);
    let back: RunJob = messages::decode(&bytes).unwrap();
    assert_eq!(back, job);
    assert_eq!(back.context, ctx);
}

#[test]
fn minimal_context_uses_defaults() {
    let run_id = RunId::new();
    let raw = json!({
        "run_id": run_id.to_string(),
        "trigger": {"type": "message.received", "source": "system"},
        "event": {"event_id": "e", "event_type": "message.received", "source": "system"},
        "input": {},
        "delivery": {"surface": "api"},
        "resources": {},
        "context": {"inline_policy": {"mode": "none"}, "available_apis": {}},
        "runtime": {"trace_id": run_id.to_string()}
    });
    let ctx: AgentRunContext = serde_json::from_value(raw).unwrap();
    assert!(ctx.conversation.is_none() && ctx.adapter.is_none());
    assert!(!ctx.context.available_apis.history_page);
    assert!(ctx.state.conversation.is_empty());
    assert!(ctx.resources.storage == Default::default());
}

#[test]
fn context_rejects_invalid_closed_values() {
    let run_id = RunId::new();
    let mut raw = full_context(run_id);
    raw["trigger"]["source"] = json!("carrier_pigeon");
    assert!(serde_json::from_value::<AgentRunContext>(raw).is_err());

    let mut raw = full_context(run_id);
    raw["resources"]["tools"][0]["operations"] = json!(["execute"]);
    assert!(serde_json::from_value::<AgentRunContext>(raw).is_err());

    let mut raw = full_context(run_id);
    raw.as_object_mut().unwrap().remove("event");
    assert!(
        serde_json::from_value::<AgentRunContext>(raw).is_err(),
        "event is required"
    );

    let mut raw = full_context(run_id);
    raw["run_id"] = json!("not-a-uuid");
    assert!(serde_json::from_value::<AgentRunContext>(raw).is_err());
}
