"""The Host API for one run (``ctx.api``; the seed's ``AgentRunAPIProxy``).

A call writes ``{"op": "api", "id", "run_id", "action", "params"}`` with a fresh id and
blocks the calling thread until the reader thread routes the ``api_result`` with that id
back (``api_chunk`` lines with the same id come first for streamed answers). Any number of
threads and runs can have calls in flight at once. A call returns the answer's ``data`` as
parsed JSON, or raises :class:`~switchboard_runner.errors.HostApiError`.

The waits end early: ``cancelled`` when the host cancels the run, ``deadline_exceeded``
when ``ctx.runtime.deadline_at`` passes, ``unavailable`` when the host connection closes.
The helpers only build ``params``; the host checks every call against the run's frozen
authorization, so nothing is checked locally.
"""

from __future__ import annotations

import base64
import itertools
import queue
import threading
import time
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

from .errors import EmitError, ErrorCode, HostApiError
from .wire import Output, encode_line

__all__ = ["AgentRunAPIProxy", "ApiCallStream", "ApiRouter", "HostApi", "LlmStream"]

T = TypeVar("T")

# A reply routed to a waiting call: ("chunk", data) | ("ok", data) | ("error", HostApiError).
_Reply = tuple[str, Any]


class _Call:
    __slots__ = ("id", "run_id", "action", "replies")

    def __init__(self, call_id: str, run_id: str, action: str) -> None:
        self.id = call_id
        self.run_id = run_id
        self.action = action
        self.replies: queue.SimpleQueue[_Reply] = queue.SimpleQueue()


class ApiRouter:
    """Call ids and the routing of answers, shared by every run of the process."""

    def __init__(self, output: Output) -> None:
        self._out = output
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._calls: dict[str, _Call] = {}
        self._closed: HostApiError | None = None

    def start(self, run_id: str, action: str, params: Mapping[str, Any]) -> _Call:
        with self._lock:
            if self._closed is not None:
                closed = self._closed
                raise HostApiError(closed.code, closed.message, closed.retryable, closed.details)
            call = _Call(str(next(self._ids)), run_id, action)
            self._calls[call.id] = call
        message = {"op": "api", "id": call.id, "run_id": run_id, "action": action, "params": params}
        try:
            line = encode_line(message, self._out.max_line_bytes)
        except EmitError as e:
            self.forget(call.id)
            raise HostApiError(ErrorCode.INVALID_ARGUMENT, str(e)) from e
        try:
            self._out.send_line(line)
        except EmitError as e:
            self.forget(call.id)
            raise HostApiError(ErrorCode.UNAVAILABLE, str(e), retryable=True) from e
        return call

    def forget(self, call_id: str) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._calls)

    def route_result(self, message: Mapping[str, Any]) -> bool:
        """Routes an ``api_result``; False if no call waits for its id (ignored)."""
        call_id = message.get("id")
        with self._lock:
            call = self._calls.pop(call_id, None) if isinstance(call_id, str) else None
        if call is None:
            return False
        if message.get("ok") is True:
            call.replies.put(("ok", message.get("data")))
        else:
            call.replies.put(("error", HostApiError.from_wire(message.get("error"))))
        return True

    def route_chunk(self, message: Mapping[str, Any]) -> bool:
        """Routes an ``api_chunk``; False if no call waits for its id (ignored)."""
        call_id = message.get("id")
        with self._lock:
            call = self._calls.get(call_id) if isinstance(call_id, str) else None
        if call is None:
            return False
        call.replies.put(("chunk", message.get("data")))
        return True

    def fail_run(self, run_id: str, error: HostApiError) -> None:
        """Ends every in-flight call of ``run_id`` with ``error`` (the run was cancelled)."""
        with self._lock:
            calls = [c for c in self._calls.values() if c.run_id == run_id]
            for c in calls:
                del self._calls[c.id]
        for c in calls:
            c.replies.put(("error", error))

    def close(self, error: HostApiError) -> None:
        """Ends every in-flight call and refuses new ones (the host stopped answering)."""
        with self._lock:
            self._closed = error
            calls = list(self._calls.values())
            self._calls.clear()
        for c in calls:
            c.replies.put(("error", error))


def _params(**params: Any) -> dict[str, Any]:
    """``params`` without the unset (``None``) arguments; the host reads null as absent."""
    return {k: v for k, v in params.items() if v is not None}


class HostApi:
    """The Host API of one run. Safe to use from several threads of the run."""

    def __init__(
        self,
        run_id: str,
        router: ApiRouter,
        cancelled: threading.Event,
        deadline: float | None = None,
    ) -> None:
        self.run_id = run_id
        self._router = router
        self._cancelled = cancelled
        self._deadline = deadline

    # The transport ---------------------------------------------------------------------

    def call(self, action: str, params: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Calls any action with raw ``params``; returns the answer's ``data``.

        ``timeout`` (seconds) bounds this wait further than the run's deadline.
        """
        call, until = self._start(action, params, timeout)
        while True:
            kind, payload = self._next(call, until)
            if kind == "ok":
                return payload
            if kind == "error":
                raise payload
            # Chunks of a call made without stream(): not asked for, dropped.

    def stream(self, action: str, params: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> ApiCallStream[Any]:
        """Calls an action whose answer is streamed: iterate for the ``api_chunk`` data;
        the final answer is then in :attr:`ApiCallStream.result`."""
        call, until = self._start(action, params, timeout)
        return ApiCallStream(self, call, until, lambda data: data)

    def _start(self, action: str, params: Mapping[str, Any] | None, timeout: float | None) -> tuple[_Call, float | None]:
        if self._cancelled.is_set():
            raise HostApiError(ErrorCode.CANCELLED, "run was cancelled")
        until = self._deadline
        if timeout is not None:
            own = time.time() + timeout
            until = own if until is None else min(until, own)
        return self._router.start(self.run_id, action, dict(params or {})), until

    def _next(self, call: _Call, until: float | None) -> _Reply:
        while True:
            wait = None if until is None else until - time.time()
            if wait is not None and wait <= 0:
                self._router.forget(call.id)
                raise HostApiError(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"run deadline passed while waiting for `{call.action}`",
                )
            try:
                return call.replies.get(timeout=wait)
            except queue.Empty:
                continue

    def _forget(self, call: _Call) -> None:
        self._router.forget(call.id)

    # Models ----------------------------------------------------------------------------

    def invoke_llm(
        self,
        llm_model_uuid: str,
        messages: Sequence[Mapping[str, Any]],
        funcs: Sequence[Mapping[str, Any]] | None = None,
        extra_args: Mapping[str, Any] | None = None,
    ) -> Any:
        """``invoke_llm`` → ``{message, usage}``. ``llm_model_uuid`` is a ``ctx.resources.models`` id."""
        return self.call(
            "invoke_llm",
            _params(
                llm_model_uuid=llm_model_uuid,
                messages=[dict(m) for m in messages],
                funcs=None if funcs is None else [dict(f) for f in funcs],
                extra_args=None if extra_args is None else dict(extra_args),
            ),
        )

    def invoke_llm_stream(
        self,
        llm_model_uuid: str,
        messages: Sequence[Mapping[str, Any]],
        funcs: Sequence[Mapping[str, Any]] | None = None,
        extra_args: Mapping[str, Any] | None = None,
    ) -> LlmStream:
        """``invoke_llm_stream``: iterate for the ``MessageChunk``s; the final
        ``{message, usage}`` is in ``.result`` once the iteration ends."""
        call, until = self._start(
            "invoke_llm_stream",
            _params(
                llm_model_uuid=llm_model_uuid,
                messages=[dict(m) for m in messages],
                funcs=None if funcs is None else [dict(f) for f in funcs],
                extra_args=None if extra_args is None else dict(extra_args),
            ),
            None,
        )
        return LlmStream(self, call, until)

    def invoke_rerank(
        self, rerank_model_uuid: str, query: str, documents: Sequence[Any], top_k: int | None = None
    ) -> Any:
        """``invoke_rerank`` → ``{results}`` (at most 64 documents per call)."""
        return self.call(
            "invoke_rerank",
            _params(rerank_model_uuid=rerank_model_uuid, query=query, documents=list(documents), top_k=top_k),
        )

    # Tools -----------------------------------------------------------------------------

    def get_tool_detail(self, tool_name: str) -> Any:
        """``get_tool_detail`` → ``{tool: {name, description, parameters, ...}}``."""
        return self.call("get_tool_detail", {"tool_name": tool_name})

    def call_tool(self, tool_name: str, parameters: Mapping[str, Any] | None = None, call_id: str | None = None) -> Any:
        """``call_tool`` → ``{result}``. With ``call_id`` the host runs the call at most once
        per run (a repeat with the same parameters replays the first outcome)."""
        return self.call(
            "call_tool",
            _params(tool_name=tool_name, parameters=dict(parameters or {}), call_id=call_id),
        )

    # Knowledge -------------------------------------------------------------------------

    def retrieve_knowledge(
        self, kb_id: str, query_text: str, top_k: int | None = None, filters: Mapping[str, Any] | None = None
    ) -> Any:
        """``retrieve_knowledge`` → ``{results: [{content, score, document_id, title, chunk_index}]}``
        (host default ``top_k`` 5)."""
        return self.call(
            "retrieve_knowledge",
            _params(kb_id=kb_id, query_text=query_text, top_k=top_k, filters=None if filters is None else dict(filters)),
        )

    # History, events, steering ---------------------------------------------------------

    def get_prompt(self) -> Any:
        """``get_prompt`` (this host has no query prompts: refused or ``not_found``)."""
        return self.call("get_prompt", {})

    def history_page(
        self,
        conversation_id: str | None = None,
        before_cursor: str | None = None,
        after_cursor: str | None = None,
        limit: int | None = None,
        direction: str | None = None,
        include_artifacts: bool = False,
    ) -> Any:
        """``history_page`` → ``HistoryPage {items, next_cursor, prev_cursor, has_more, total_count}``
        (defaults: the run's conversation, 50 items, ``backward``)."""
        return self.call(
            "history_page",
            _params(
                conversation_id=conversation_id,
                before_cursor=before_cursor,
                after_cursor=after_cursor,
                limit=limit,
                direction=direction,
                include_artifacts=include_artifacts or None,
            ),
        )

    def history_search(self, query: str, filters: Mapping[str, Any] | None = None, top_k: int | None = None) -> Any:
        """``history_search`` → ``{items, total_count, query}``; ``filters``:
        ``conversation_id``, ``roles``, ``item_types``."""
        return self.call(
            "history_search",
            _params(query=query, filters=None if filters is None else dict(filters), top_k=top_k),
        )

    def event_get(self, event_id: str) -> Any:
        """``event_get`` → an ``AgentEventRecord``."""
        return self.call("event_get", {"event_id": event_id})

    def event_page(
        self,
        conversation_id: str | None = None,
        event_types: Sequence[str] | None = None,
        before_cursor: str | None = None,
        limit: int | None = None,
    ) -> Any:
        """``event_page`` → ``EventPage {items, next_cursor, ...}`` (newest first)."""
        return self.call(
            "event_page",
            _params(
                conversation_id=conversation_id,
                event_types=None if event_types is None else list(event_types),
                before_cursor=before_cursor,
                limit=limit,
            ),
        )

    def steering_pull(self, mode: str | None = None, limit: int | None = None) -> Any:
        """``steering_pull`` → ``{items}``: follow-up messages claimed by this run
        (``mode`` ``all``, the default, or ``one``)."""
        return self.call("steering_pull", _params(mode=mode, limit=limit))

    # Artifacts -------------------------------------------------------------------------

    def artifact_metadata(self, artifact_id: str) -> Any:
        """``artifact_metadata`` → ``ArtifactMetadata``."""
        return self.call("artifact_metadata", {"artifact_id": artifact_id})

    def artifact_read(self, artifact_id: str, offset: int = 0, limit: int | None = None) -> Any:
        """``artifact_read`` → ``ArtifactReadResult {content_base64, has_more, ...}``
        (host default 1 MiB, at most 10 MiB per read)."""
        return self.call("artifact_read", _params(artifact_id=artifact_id, offset=offset, limit=limit))

    def artifact_read_range(self, artifact_id: str, offset: int = 0, length: int = 65536) -> Any:
        """The seed's ranged read: ``artifact_read`` with ``length``."""
        return self.call("artifact_read", {"artifact_id": artifact_id, "offset": offset, "length": length})

    # State -----------------------------------------------------------------------------

    def state_get(self, scope: str, key: str) -> Any:
        """``state_get`` → ``{value, revision}`` (``{value: null, revision: 0}`` when unset)."""
        return self.call("state_get", {"scope": scope, "key": key})

    def state_set(self, scope: str, key: str, value: Any, if_revision: int | None = None) -> Any:
        """``state_set`` → ``{success, revision}``; ``if_revision`` makes it a compare-and-set
        (``0``: the key must not exist)."""
        params: dict[str, Any] = {"scope": scope, "key": key, "value": value}
        if if_revision is not None:
            params["if_revision"] = if_revision
        return self.call("state_set", params)

    def state_delete(self, scope: str, key: str, if_revision: int | None = None) -> Any:
        """``state_delete`` → ``{success}``."""
        return self.call("state_delete", _params(scope=scope, key=key, if_revision=if_revision))

    def state_list(self, scope: str, prefix: str | None = None, limit: int | None = None, cursor: str | None = None) -> Any:
        """``state_list`` → ``{keys, has_more, next_cursor}``."""
        return self.call("state_list", _params(scope=scope, prefix=prefix, limit=limit, cursor=cursor))

    # Storage (bytes; base64 on the wire) -----------------------------------------------

    def storage_get(self, owner_type: str, key: str) -> bytes:
        """``storage_get`` (``owner_type`` ``plugin`` or ``workspace``) → the stored bytes;
        ``not_found`` when the key is unset."""
        data = self.call("storage_get", {"owner_type": owner_type, "key": key})
        encoded = data.get("value_base64") if isinstance(data, Mapping) else None
        if not isinstance(encoded, str):
            raise HostApiError(ErrorCode.RUNTIME_ERROR, "storage_get answer has no value_base64")
        return base64.b64decode(encoded)

    def storage_set(self, owner_type: str, key: str, value: bytes | str) -> Any:
        """``storage_set``: ``value`` (bytes, or text stored as UTF-8), at most 10 MiB."""
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return self.call(
            "storage_set",
            {"owner_type": owner_type, "key": key, "value_base64": base64.b64encode(raw).decode("ascii")},
        )

    def storage_delete(self, owner_type: str, key: str) -> Any:
        """``storage_delete``."""
        return self.call("storage_delete", {"owner_type": owner_type, "key": key})

    def storage_keys(self, owner_type: str) -> list[str]:
        """``storage_keys`` → the keys."""
        data = self.call("storage_keys", {"owner_type": owner_type})
        keys = data.get("keys") if isinstance(data, Mapping) else None
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []

    # The seed's storage names.
    def get_plugin_storage(self, key: str) -> bytes:
        return self.storage_get("plugin", key)

    def set_plugin_storage(self, key: str, value: bytes | str) -> Any:
        return self.storage_set("plugin", key, value)

    def delete_plugin_storage(self, key: str) -> Any:
        return self.storage_delete("plugin", key)

    def get_plugin_storage_keys(self) -> list[str]:
        return self.storage_keys("plugin")

    def get_workspace_storage(self, key: str) -> bytes:
        return self.storage_get("workspace", key)

    def set_workspace_storage(self, key: str, value: bytes | str) -> Any:
        return self.storage_set("workspace", key, value)

    def delete_workspace_storage(self, key: str) -> Any:
        return self.storage_delete("workspace", key)

    def get_workspace_storage_keys(self) -> list[str]:
        return self.storage_keys("workspace")

    # Files and host --------------------------------------------------------------------

    def get_config_file(self, file_key: str) -> Any:
        """``get_config_file`` (a file of the runner config; this host has no provider yet)."""
        return self.call("get_config_file", {"file_key": file_key})

    def get_file(self, file_key: str) -> Any:
        """The seed's name of :meth:`get_config_file`."""
        return self.get_config_file(file_key)

    def get_host_version(self) -> Any:
        """``get_host_version`` → ``{version, protocol, host}``."""
        return self.call("get_host_version", {})

    def get_langbot_version(self) -> str:
        """The seed's version call: the host version string."""
        data = self.get_host_version()
        version = data.get("version") if isinstance(data, Mapping) else None
        return version if isinstance(version, str) else ""

    def ping(self) -> Any:
        """``ping`` → ``{}``."""
        return self.call("ping", {})


#: The seed SDK's name of :class:`HostApi`.
AgentRunAPIProxy = HostApi


class ApiCallStream(Generic[T]):
    """The streamed answer of one call: an iterator over its chunks.

    When the iteration ends the final answer is in :attr:`result`; a refusal raises
    :class:`HostApiError` from the iteration. Stop early with :meth:`close` (or use it as a
    context manager): later chunks are then dropped.
    """

    def __init__(self, api: HostApi, call: _Call, until: float | None, transform: Callable[[Any], T]) -> None:
        self._api = api
        self._call = call
        self._until = until
        self._transform = transform
        self._finished = False
        #: The final ``data`` of the answer, once the iteration ended.
        self.result: Any = None

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        try:
            kind, payload = self._api._next(self._call, self._until)
        except BaseException:
            self._finished = True
            raise
        if kind == "chunk":
            return self._transform(payload)
        self._finished = True
        if kind == "ok":
            self.result = payload
            raise StopIteration
        raise payload

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._api._forget(self._call)

    def __enter__(self) -> ApiCallStream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlmStream(ApiCallStream[dict[str, Any]]):
    """``invoke_llm_stream``: yields ``MessageChunk`` dicts (``{"role", "content", ...}``);
    :attr:`result` is ``{message, usage}`` at the end."""

    def __init__(self, api: HostApi, call: _Call, until: float | None) -> None:
        super().__init__(api, call, until, _chunk_of)

    def text(self) -> str:
        """Consumes the stream and returns the concatenated text of its chunks."""
        parts: list[str] = []
        for chunk in self:
            content = chunk.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
        return "".join(parts)


def _chunk_of(data: Any) -> dict[str, Any]:
    if isinstance(data, dict):
        chunk = data.get("chunk")
        if isinstance(chunk, dict):
            return chunk
        return data
    return {"content": data}
