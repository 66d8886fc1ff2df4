"""The run context as the runner sees it (PROTOCOL_V1 §5–§6), as read-only dataclasses.

Field names are the protocol's. Parsing is lenient: unknown keys are ignored (a newer host
may add fields; the whole context stays available as :attr:`RunContext.raw`), missing
keys take the protocol defaults.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, TypeVar, Union

if TYPE_CHECKING:
    from .api import HostApi
    from .emit import Emitter

__all__ = [
    "ActorContext",
    "AdapterContext",
    "AgentEventContext",
    "AgentInput",
    "AgentResources",
    "AgentRunContext",
    "AgentRunState",
    "AgentRuntimeContext",
    "AgentTrigger",
    "ContextAPICapabilities",
    "ContextAccess",
    "ConversationContext",
    "DeliveryContext",
    "FileResource",
    "InlineContextPolicy",
    "KnowledgeBaseResource",
    "ModelResource",
    "RunContext",
    "SkillResource",
    "StorageResource",
    "SubjectContext",
    "ToolResource",
    "parse_context",
]

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class AgentTrigger:
    type: str = ""
    source: str = ""
    timestamp: int | None = None


@dataclass(frozen=True)
class AgentEventContext:
    event_id: str = ""
    event_type: str = ""
    event_time: int | None = None
    source: str = ""
    source_event_type: str | None = None
    #: ``{ref_type, ref_id, mime_type?, size_bytes?, metadata}`` when the raw payload is stored.
    raw_ref: JsonObject | None = None
    data: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class ConversationContext:
    conversation_id: str | None = None
    thread_id: str | None = None
    launcher_type: str | None = None
    launcher_id: str | None = None
    sender_id: str | None = None
    bot_id: str | None = None
    workspace_id: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class ActorContext:
    actor_type: str = ""
    actor_id: str | None = None
    actor_name: str | None = None
    metadata: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class SubjectContext:
    subject_type: str = ""
    subject_id: str | None = None
    data: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class AgentInput:
    text: str | None = None
    #: Content blocks (``{"type": "text" | "image" | ..., ...}``).
    contents: list[JsonObject] = field(default_factory=list)
    #: Artifact refs (``{"artifact_id", "artifact_type", "mime_type", ...}``).
    attachments: list[JsonObject] = field(default_factory=list)


@dataclass(frozen=True)
class DeliveryContext:
    surface: str = ""
    reply_target: JsonObject | None = None
    supports_streaming: bool = False
    supports_edit: bool = False
    supports_reaction: bool = False
    max_message_size: int | None = None
    platform_capabilities: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class ModelResource:
    model_id: str = ""
    model_type: str | None = None
    provider: str | None = None
    operations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ToolResource:
    tool_name: str = ""
    tool_type: str | None = None
    description: str | None = None
    operations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KnowledgeBaseResource:
    kb_id: str = ""
    kb_name: str | None = None
    kb_type: str | None = None
    operations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SkillResource:
    skill_name: str = ""
    display_name: str | None = None
    description: str | None = None


@dataclass(frozen=True)
class FileResource:
    file_id: str = ""
    file_name: str | None = None
    mime_type: str | None = None
    source: str | None = None
    operations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StorageResource:
    plugin_storage: bool = False
    workspace_storage: bool = False


@dataclass(frozen=True)
class AgentResources:
    """What this run may use: the frozen result of ``permissions ∩ policy ∩ what exists``."""

    models: list[ModelResource] = field(default_factory=list)
    tools: list[ToolResource] = field(default_factory=list)
    knowledge_bases: list[KnowledgeBaseResource] = field(default_factory=list)
    skills: list[SkillResource] = field(default_factory=list)
    files: list[FileResource] = field(default_factory=list)
    storage: StorageResource = field(default_factory=StorageResource)
    platform_capabilities: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class InlineContextPolicy:
    mode: str = "current_event"
    delivered_count: int = 0
    source_total_count: int | None = None
    messages_complete: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class ContextAPICapabilities:
    """Which context APIs this run may call (``ctx.context.available_apis``)."""

    history_page: bool = False
    history_search: bool = False
    event_get: bool = False
    event_page: bool = False
    artifact_metadata: bool = False
    artifact_read: bool = False
    state: bool = False
    storage: bool = False
    steering_pull: bool = False
    prompt_get: bool = False


@dataclass(frozen=True)
class ContextAccess:
    conversation_id: str | None = None
    thread_id: str | None = None
    latest_cursor: str | None = None
    event_seq: int | None = None
    transcript_seq: int | None = None
    has_history_before: bool = False
    inline_policy: InlineContextPolicy = field(default_factory=InlineContextPolicy)
    available_apis: ContextAPICapabilities = field(default_factory=ContextAPICapabilities)


@dataclass(frozen=True)
class AgentRuntimeContext:
    langbot_version: str | None = None
    trace_id: str = ""
    #: Epoch seconds after which the host fails the run with ``timeout``.
    deadline_at: float | None = None
    #: Host metadata, e.g. ``host_api: {url, token}`` (the remote Host API of the run).
    metadata: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class AgentRunState:
    """Host-owned state snapshot, by scope."""

    conversation: JsonObject = field(default_factory=dict)
    actor: JsonObject = field(default_factory=dict)
    subject: JsonObject = field(default_factory=dict)
    runner: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterContext:
    extra: JsonObject = field(default_factory=dict)


@dataclass(frozen=True)
class AgentRunContext:
    """``AgentRunContext`` (PROTOCOL_V1 §5.2)."""

    run_id: str = ""
    trigger: AgentTrigger = field(default_factory=AgentTrigger)
    event: AgentEventContext = field(default_factory=AgentEventContext)
    conversation: ConversationContext | None = None
    actor: ActorContext | None = None
    subject: SubjectContext | None = None
    input: AgentInput = field(default_factory=AgentInput)
    delivery: DeliveryContext = field(default_factory=DeliveryContext)
    resources: AgentResources = field(default_factory=AgentResources)
    context: ContextAccess = field(default_factory=ContextAccess)
    state: AgentRunState = field(default_factory=AgentRunState)
    runtime: AgentRuntimeContext = field(default_factory=AgentRuntimeContext)
    config: JsonObject = field(default_factory=dict)
    adapter: AdapterContext | None = None
    metadata: JsonObject = field(default_factory=dict)


T = TypeVar("T")


def _convert(tp: Any, value: Any) -> Any:
    """Converts JSON ``value`` to type ``tp`` where it is a dataclass or a container of them."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return [_convert(item, v) for v in value] if isinstance(value, list) else []
    if origin is dict or tp is dict:
        return dict(value) if isinstance(value, Mapping) else {}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _build(cls: type[T], data: Any) -> T:
    if not isinstance(data, Mapping):
        data = {}
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        value, tp = data[f.name], hints[f.name]
        if value is None and not _optional(tp):
            continue  # an explicit null where the protocol has a default: keep the default
        kwargs[f.name] = _convert(tp, value)
    return cls(**kwargs)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def parse_context(raw: Mapping[str, Any]) -> AgentRunContext:
    """Parses the ``context`` of a ``run`` message."""
    return _build(AgentRunContext, raw)


class RunContext:
    """One run, handed to ``AgentRunner.run(ctx)``.

    The protocol's context fields are attributes (``ctx.event``, ``ctx.input``,
    ``ctx.conversation``, ``ctx.context``, ``ctx.runtime``, ``ctx.config``,
    ``ctx.resources``, …); ``ctx.emit`` writes results, ``ctx.api`` calls the Host API for
    this run, ``ctx.cancelled`` / ``ctx.wait_cancelled()`` observe a cancel.
    """

    def __init__(
        self,
        run_id: str,
        runner_id: str,
        raw: Mapping[str, Any],
        emit: Emitter,
        api: HostApi,
        cancel: threading.Event,
    ) -> None:
        self.run_id: str = run_id
        #: The runner id this run is for (``plugin:<author>/<plugin>/<runner>``).
        self.runner_id: str = runner_id
        #: The ``AgentRunContext`` exactly as the host sent it.
        self.raw: dict[str, Any] = dict(raw)
        #: The typed ``AgentRunContext``.
        self.agent_context: AgentRunContext = parse_context(raw)
        self.emit: Emitter = emit
        self.api: HostApi = api
        self._cancel = cancel
        self._cancel_reason: str | None = None

    # The PROTOCOL_V1 context fields -----------------------------------------------------

    @property
    def trigger(self) -> AgentTrigger:
        return self.agent_context.trigger

    @property
    def event(self) -> AgentEventContext:
        return self.agent_context.event

    @property
    def conversation(self) -> ConversationContext | None:
        return self.agent_context.conversation

    @property
    def actor(self) -> ActorContext | None:
        return self.agent_context.actor

    @property
    def subject(self) -> SubjectContext | None:
        return self.agent_context.subject

    @property
    def input(self) -> AgentInput:
        return self.agent_context.input

    @property
    def delivery(self) -> DeliveryContext:
        return self.agent_context.delivery

    @property
    def resources(self) -> AgentResources:
        return self.agent_context.resources

    @property
    def context(self) -> ContextAccess:
        return self.agent_context.context

    @property
    def state(self) -> AgentRunState:
        return self.agent_context.state

    @property
    def runtime(self) -> AgentRuntimeContext:
        return self.agent_context.runtime

    @property
    def config(self) -> JsonObject:
        return self.agent_context.config

    @property
    def adapter(self) -> AdapterContext | None:
        return self.agent_context.adapter

    @property
    def metadata(self) -> JsonObject:
        return self.agent_context.metadata

    # Conveniences ---------------------------------------------------------------------

    @property
    def input_text(self) -> str:
        """``input.text``, or ``""``."""
        return self.agent_context.input.text or ""

    @property
    def conversation_id(self) -> str | None:
        """The run's conversation (``context.conversation_id``), if any."""
        return self.agent_context.context.conversation_id

    @property
    def deadline(self) -> float | None:
        """``runtime.deadline_at`` (epoch seconds), if any."""
        return self.agent_context.runtime.deadline_at

    def time_left(self) -> float | None:
        """Seconds until the deadline (never negative), or ``None`` without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.time())

    # Cancellation ---------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the host asked to cancel this run (or its deadline passed)."""
        return self._cancel.is_set()

    @property
    def cancel_reason(self) -> str | None:
        """The reason the host gave, once cancelled."""
        return self._cancel_reason

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Sleeps up to ``timeout`` seconds (forever if ``None``), waking early on cancel.

        Returns True if the run is cancelled. Use it instead of ``time.sleep`` in waits and
        polling loops.
        """
        return self._cancel.wait(timeout)

    def _mark_cancelled(self, reason: str) -> None:
        if self._cancel_reason is None:
            self._cancel_reason = reason
        self._cancel.set()

    def log(self, message: str, level: str = "info") -> None:
        """A line for the worker's log, tagged with this run (``op: log``)."""
        self.emit.log(message, level)

    def __repr__(self) -> str:
        return f"RunContext(run_id={self.run_id!r}, runner_id={self.runner_id!r})"
