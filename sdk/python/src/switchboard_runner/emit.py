"""Result output of one run: :class:`Emitter` (``ctx.emit``)."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from . import results
from .errors import EmitError, RunFinished
from .results import Content, StateScope
from .wire import Output

__all__ = ["Emitter"]


class Emitter:
    """Writes the results of one run, numbering them ``sequence`` 1, 2, 3, ….

    One method per result type, named like the type (``message.delta`` →
    :meth:`message_delta`), with the arguments of the builders in
    :mod:`switchboard_runner.results`. The run ends at its first terminal result
    (``run.completed`` / ``run.failed``): after it every method except :meth:`log` raises
    :class:`RunFinished`, because the host drops anything more. Safe to share between the
    run's helper threads.
    """

    def __init__(self, run_id: str, output: Output) -> None:
        self._run_id = run_id
        self._out = output
        self._lock = threading.Lock()
        self._next_sequence = 1
        self._terminal = False
        self._done = False
        self._messages = 0

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def finished(self) -> bool:
        """True once a terminal result was written (or ``done`` was sent)."""
        with self._lock:
            return self._terminal or self._done

    @property
    def message_count(self) -> int:
        """How many ``message.*`` results were written."""
        with self._lock:
            return self._messages

    def emit(self, result: Mapping[str, Any]) -> None:
        """Writes a whole ``AgentRunResult`` envelope (``{"type", "data", ...}``).

        ``run_id`` and ``sequence`` are set by the SDK (given values are replaced).
        """
        result_type = result.get("type")
        if not isinstance(result_type, str) or not result_type:
            # The host would abort the run with runner.protocol_error ("missing result type").
            raise EmitError("a result needs a non-empty string `type`")
        envelope = dict(result)
        with self._lock:
            if self._terminal or self._done:
                raise RunFinished(f"run {self._run_id} already finished; {result_type} not sent")
            envelope["run_id"] = self._run_id
            envelope["sequence"] = self._next_sequence
            # Written under the run's lock, so sequences reach the wire in order even when
            # several threads emit for the same run.
            self._out.result(self._run_id, envelope)
            self._next_sequence += 1
            if result_type in results.TERMINAL_TYPES:
                self._terminal = True
            elif result_type.startswith("message."):
                self._messages += 1

    def result(self, result_type: str, data: Mapping[str, Any]) -> None:
        """Any result type with its ``data`` payload."""
        self.emit(results.envelope(result_type, data))

    def message_delta(
        self,
        content: Content | None = None,
        *,
        role: str = "assistant",
        tool_calls: Sequence[Mapping[str, Any]] | None = None,
        is_final: bool = False,
        msg_sequence: int | None = None,
        chunk: Mapping[str, Any] | None = None,
    ) -> None:
        """``message.delta``: a streamed piece of the reply."""
        self.emit(
            results.message_delta(
                content,
                role=role,
                tool_calls=tool_calls,
                is_final=is_final,
                msg_sequence=msg_sequence,
                chunk=chunk,
            )
        )

    def message_completed(
        self,
        content: Content | None = None,
        *,
        role: str = "assistant",
        tool_calls: Sequence[Mapping[str, Any]] | None = None,
        artifact_refs: Sequence[Mapping[str, Any]] | None = None,
        message: Mapping[str, Any] | None = None,
    ) -> None:
        """``message.completed``: the complete reply."""
        self.emit(
            results.message_completed(
                content, role=role, tool_calls=tool_calls, artifact_refs=artifact_refs, message=message
            )
        )

    def tool_call_started(
        self, tool_call_id: str, tool_name: str, parameters: Mapping[str, Any] | None = None
    ) -> None:
        """``tool.call.started`` (telemetry)."""
        self.emit(results.tool_call_started(tool_call_id, tool_name, parameters))

    def tool_call_completed(
        self,
        tool_call_id: str,
        tool_name: str,
        result: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """``tool.call.completed`` (telemetry)."""
        self.emit(results.tool_call_completed(tool_call_id, tool_name, result, error))

    def artifact_created(
        self,
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
    ) -> None:
        """``artifact.created`` (inline ``content`` at most 1 MiB)."""
        self.emit(
            results.artifact_created(
                artifact_type,
                content=content,
                artifact_id=artifact_id,
                mime_type=mime_type,
                name=name,
                size_bytes=size_bytes,
                sha256=sha256,
                metadata=metadata,
                content_base64=content_base64,
            )
        )

    def state_updated(self, scope: StateScope | str, key: str, value: Any) -> None:
        """``state.updated``: store a small JSON value in host-owned state."""
        self.emit(results.state_updated(scope, key, value))

    def action_requested(
        self,
        action: str,
        target: Mapping[str, Any] | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> None:
        """``action.requested`` (recorded, never executed by the host)."""
        self.emit(results.action_requested(action, target, payload))

    def run_completed(
        self, finish_reason: str = "stop", message: Content | Mapping[str, Any] | None = None
    ) -> None:
        """``run.completed``: the run ended normally."""
        self.emit(results.run_completed(finish_reason, message))

    def run_failed(self, error: str, code: str = "runner.error", retryable: bool = False) -> None:
        """``run.failed``: the run ended with an error (``cancelled`` for an honoured cancel)."""
        self.emit(results.run_failed(error, code, retryable))

    def log(self, message: str, level: str = "info") -> None:
        """A line for the worker's log (``op: log``), tagged with this run."""
        self._out.log(level, message, self._run_id)

    def done(self) -> None:
        """Sends ``done`` (the run's result stream ended). Idempotent; the SDK calls it."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._out.done(self._run_id)
