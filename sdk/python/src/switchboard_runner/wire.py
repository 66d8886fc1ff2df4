"""The stdio wire: one JSON object per line, UTF-8, in both directions.

Host → runner ``op`` values: ``run``, ``cancel``, ``api_result``, ``api_chunk``,
``shutdown``. Runner → host: ``result``, ``done``, ``api``, ``log``. See
``docs/RUNNERS.md`` for every message.

:class:`Output` is the process-wide writer: each message is serialised first, then written
as one whole line under a lock and flushed, so lines of concurrent runs never interleave.
"""

from __future__ import annotations

import json
import threading
from typing import IO, Any, Mapping

from .errors import EmitError

__all__ = [
    "HOST_OPS",
    "MAX_LINE_BYTES",
    "Output",
    "WireError",
    "decode_line",
    "encode_line",
]

#: The host's default cap on one runner line (``worker.max_line_bytes``, 4 MiB). A longer
#: line fails the run it belongs to with ``runner.protocol_error``.
MAX_LINE_BYTES = 4 * 1024 * 1024

#: The ops a host sends.
HOST_OPS = frozenset({"run", "cancel", "api_result", "api_chunk", "shutdown"})

#: Log levels the host understands (it also reads ``warning``, ``fatal``, ``critical``).
LOG_LEVELS = frozenset({"trace", "debug", "info", "warn", "error"})


class WireError(ValueError):
    """A host line that is not one JSON object."""


def encode_line(message: Mapping[str, Any], max_bytes: int = MAX_LINE_BYTES) -> bytes:
    """Serialises ``message`` as one line (with its ``\\n``).

    Raises :class:`EmitError` if it is not JSON-serialisable (NaN and infinities included:
    the host's parser rejects them) or longer than ``max_bytes``. JSON escapes every
    newline inside strings, so the result is always a single line.
    """
    try:
        text = json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise EmitError(f"message is not JSON-serialisable: {e}") from e
    line = text.encode("utf-8") + b"\n"
    if len(line) > max_bytes:
        raise EmitError(f"message of {len(line)} bytes exceeds the line limit of {max_bytes} bytes")
    return line


def decode_line(line: bytes | str) -> dict[str, Any]:
    """Parses one host line into its JSON object (:class:`WireError` otherwise)."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"host line is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise WireError("host line is not a JSON object")
    return value


class Output:
    """Writes whole lines to the protocol stream, one writer at a time."""

    def __init__(self, stream: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.max_line_bytes = max_line_bytes

    def send(self, message: Mapping[str, Any]) -> None:
        """Writes one message and flushes it. Raises :class:`EmitError` on failure."""
        line = encode_line(message, self.max_line_bytes)
        self.send_line(line)

    def send_line(self, line: bytes) -> None:
        with self._lock:
            try:
                self._stream.write(line)
                self._stream.flush()
            except (OSError, ValueError) as e:  # ValueError: write to a closed file
                raise EmitError(f"writing to the host failed: {e}") from e

    # Message builders (runner → host) -------------------------------------------------

    def result(self, run_id: str, envelope: Mapping[str, Any]) -> None:
        self.send({"op": "result", "run_id": run_id, "result": envelope})

    def done(self, run_id: str) -> None:
        self.send({"op": "done", "run_id": run_id})

    def api(self, call_id: str, run_id: str, action: str, params: Mapping[str, Any]) -> None:
        self.send({"op": "api", "id": call_id, "run_id": run_id, "action": action, "params": params})

    def log(self, level: str, message: str, run_id: str | None = None) -> None:
        msg: dict[str, Any] = {"op": "log", "level": level, "message": message}
        if run_id is not None:
            msg["run_id"] = run_id
        self.send(msg)
