"""Builders of ``AgentRunResult`` envelopes (PROTOCOL_V1 §7), one per result type.

Each function returns ``{"type": ..., "data": {...}}``; the function names are the
protocol's type names with dots replaced by underscores. A runner can ``yield`` these from
``run`` (the seed's generator style) or emit them through ``ctx.emit``, whose methods have
the same names and arguments.

The host checks ``message.*``, ``artifact.created``, ``state.updated``,
``action.requested`` and ``run.*`` strictly (unknown fields are refused and the result is
dropped); ``tool.call.*`` are telemetry and accepted as they come.
"""

from __future__ import annotations

import base64
from typing import Any, Final, Literal, Mapping, Sequence, Union

__all__ = [
    "RESULT_TYPES",
    "TERMINAL_TYPES",
    "Content",
    "StateScope",
    "action_requested",
    "artifact_created",
    "envelope",
    "message_completed",
    "message_delta",
    "run_completed",
    "run_failed",
    "state_updated",
    "tool_call_completed",
    "tool_call_started",
]

#: The nine stable result types (PROTOCOL_V1 §7.3). The host drops unknown types with a
#: warning.
RESULT_TYPES: Final = (
    "message.delta",
    "message.completed",
    "tool.call.started",
    "tool.call.completed",
    "artifact.created",
    "state.updated",
    "action.requested",
    "run.completed",
    "run.failed",
)

#: The types that end a run.
TERMINAL_TYPES: Final = frozenset({"run.completed", "run.failed"})

#: Message content: a plain string or a list of content blocks (``{"type": "text", "text":
#: ...}``, ``image``, ``reasoning``, ``tool_call``, ``tool_result``).
Content = Union[str, Sequence[Mapping[str, Any]]]

StateScope = Literal["conversation", "actor", "subject", "runner"]


def envelope(result_type: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """Any result: ``{"type": result_type, "data": data}``."""
    return {"type": result_type, "data": dict(data)}


def _content(content: Content) -> Any:
    return content if isinstance(content, str) else [dict(block) for block in content]


def _message(
    content: Content | None,
    role: str,
    *,
    name: str | None = None,
    tool_calls: Sequence[Mapping[str, Any]] | None = None,
    tool_call_id: str | None = None,
    artifact_refs: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role}
    if content is not None:
        message["content"] = _content(content)
    if name is not None:
        message["name"] = name
    if tool_calls is not None:
        message["tool_calls"] = [dict(c) for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if artifact_refs:
        message["artifact_refs"] = [dict(r) for r in artifact_refs]
    return message


def message_delta(
    content: Content | None = None,
    *,
    role: str = "assistant",
    tool_calls: Sequence[Mapping[str, Any]] | None = None,
    is_final: bool = False,
    msg_sequence: int | None = None,
    chunk: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``message.delta {chunk}``: a streamed piece of the reply.

    ``chunk`` gives the whole ``MessageChunk`` instead of building it from the arguments.
    The host refuses an empty chunk (a delta with neither content nor tool calls fails the
    run with ``runner.protocol_error``).
    """
    if chunk is None:
        built = _message(content, role, tool_calls=tool_calls)
        if is_final:
            built["is_final"] = True
        if msg_sequence is not None:
            built["msg_sequence"] = msg_sequence
        chunk = built
    return envelope("message.delta", {"chunk": dict(chunk)})


def message_completed(
    content: Content | None = None,
    *,
    role: str = "assistant",
    tool_calls: Sequence[Mapping[str, Any]] | None = None,
    artifact_refs: Sequence[Mapping[str, Any]] | None = None,
    message: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``message.completed {message}``: the complete reply (it is what the transcript keeps)."""
    if message is None:
        message = _message(content, role, tool_calls=tool_calls, artifact_refs=artifact_refs)
    return envelope("message.completed", {"message": dict(message)})


def tool_call_started(
    tool_call_id: str, tool_name: str, parameters: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``tool.call.started`` (telemetry)."""
    return envelope(
        "tool.call.started",
        {"tool_call_id": tool_call_id, "tool_name": tool_name, "parameters": dict(parameters or {})},
    )


def tool_call_completed(
    tool_call_id: str,
    tool_name: str,
    result: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """``tool.call.completed`` (telemetry): ``result`` on success, ``error`` on failure."""
    return envelope(
        "tool.call.completed",
        {
            "tool_call_id": tool_call_id,
            "tool_name": tool_name,
            "result": None if result is None else dict(result),
            "error": error,
        },
    )


def artifact_created(
    artifact_type: str,
    *,
    content: bytes | None = None,
    artifact_id: str | None = None,
    mime_type: str | None = None,
    name: str | None = None,
    size_bytes: int | None = None,
    sha256: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    content_base64: str | None = None,
) -> dict[str, Any]:
    """``artifact.created``: ``content`` (bytes, at most 1 MiB) is sent inline as base64."""
    data: dict[str, Any] = {"artifact_type": artifact_type}
    if content is not None:
        content_base64 = base64.b64encode(content).decode("ascii")
        if size_bytes is None:
            size_bytes = len(content)
    optional = {
        "artifact_id": artifact_id,
        "mime_type": mime_type,
        "name": name,
        "size_bytes": size_bytes,
        "sha256": sha256,
        "metadata": None if metadata is None else dict(metadata),
        "content_base64": content_base64,
    }
    data.update({k: v for k, v in optional.items() if v is not None})
    return envelope("artifact.created", data)


def state_updated(scope: StateScope | str, key: str, value: Any) -> dict[str, Any]:
    """``state.updated {scope, key, value}``: ask the host to store a small JSON value."""
    return envelope("state.updated", {"scope": scope, "key": key, "value": value})


def action_requested(
    action: str,
    target: Mapping[str, Any] | None = None,
    payload: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``action.requested``: recorded by the host as telemetry, never executed."""
    data: dict[str, Any] = {"action": action}
    if target is not None:
        data["target"] = dict(target)
    if payload is not None:
        data["payload"] = dict(payload)
    return envelope("action.requested", data)


def run_completed(
    finish_reason: str = "stop", message: Content | Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``run.completed {finish_reason, message?}``. A string ``message`` is an assistant text."""
    data: dict[str, Any] = {"finish_reason": finish_reason}
    if isinstance(message, Mapping):
        data["message"] = dict(message)
    elif message is not None:
        data["message"] = _message(message, "assistant")
    return envelope("run.completed", data)


def run_failed(error: str, code: str = "runner.error", retryable: bool = False) -> dict[str, Any]:
    """``run.failed {code, error, retryable}``."""
    return envelope("run.failed", {"code": code, "error": error, "retryable": retryable})
