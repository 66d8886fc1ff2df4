"""A scripted host for unit tests: drives a runner over a pair of pipes, line by line."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Mapping

from switchboard_runner import serve
from switchboard_runner.serve import Runner

TIMEOUT = 10.0


class FakeHost:
    """The host side of a runner's stdio. ``recv`` returns the runner's next line as JSON."""

    def __init__(self, to_runner: IO[bytes], from_runner: IO[bytes]) -> None:
        self._to = to_runner
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.raw_lines: list[bytes] = []
        self.skipped: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, args=(from_runner,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        for line in iter(stream.readline, b""):
            self.raw_lines.append(line)
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def send(self, message: Mapping[str, Any]) -> None:
        self._to.write(json.dumps(message).encode() + b"\n")
        self._to.flush()

    def send_raw(self, data: bytes) -> None:
        self._to.write(data)
        self._to.flush()

    def close(self) -> None:
        try:
            self._to.close()
        except OSError:
            pass

    def recv(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        message = self._lines.get(timeout=timeout)
        if message is None:
            raise EOFError("runner closed its stdout")
        return message

    def expect(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = TIMEOUT) -> dict[str, Any]:
        """The first line matching ``predicate``; lines that do not match stay queued for
        later calls (in order)."""
        for i, message in enumerate(self.skipped):
            if predicate(message):
                return self.skipped.pop(i)
        while True:
            message = self.recv(timeout)
            if predicate(message):
                return message
            self.skipped.append(message)

    def eof(self, timeout: float = TIMEOUT) -> bool:
        """True once the runner's stdout is closed (after any remaining lines)."""
        while True:
            try:
                message = self._lines.get(timeout=timeout)
            except queue.Empty:
                return False
            if message is None:
                return True

    def run(self, run_id: str, context: Mapping[str, Any] | None = None, runner: str = "plugin:t/t/default") -> None:
        self.send({"op": "run", "run_id": run_id, "runner": runner, "context": dict(context or make_context(run_id))})

    def results(self, run_id: str, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """Every result of ``run_id`` up to its ``done`` (other runs' lines are kept aside)."""
        out: list[dict[str, Any]] = []
        while True:
            message = self.expect(lambda m: m.get("run_id") == run_id and m["op"] in ("result", "done"), timeout)
            if message["op"] == "done":
                return out
            out.append(message["result"])


def make_context(run_id: str, text: str = "hello", **extra: Any) -> dict[str, Any]:
    context: dict[str, Any] = {
        "run_id": run_id,
        "trigger": {"type": "message.received", "source": "api", "timestamp": 1},
        "event": {"event_id": "e-" + run_id, "event_type": "message.received", "source": "api", "data": {}},
        "conversation": {"conversation_id": "c1", "bot_id": None},
        "input": {"text": text, "contents": [], "attachments": []},
        "delivery": {"surface": "api", "supports_streaming": True},
        "resources": {"models": [], "tools": [], "storage": {"plugin_storage": True}},
        "context": {
            "conversation_id": "c1",
            "inline_policy": {"mode": "current_event"},
            "available_apis": {"history_page": True},
        },
        "state": {},
        "runtime": {"trace_id": "t", "deadline_at": None, "metadata": {"k": "v"}},
        "config": {},
        "metadata": {},
    }
    context.update(extra)
    return context


class InProcess:
    """``serve(runner)`` on a thread of this process, over two pipes."""

    def __init__(self, runner: Runner, **serve_args: Any) -> None:
        host_to_runner_r, host_to_runner_w = os.pipe()
        runner_to_host_r, runner_to_host_w = os.pipe()
        self._runner_in = os.fdopen(host_to_runner_r, "rb")
        self._runner_out = os.fdopen(runner_to_host_w, "wb")
        self.host = FakeHost(os.fdopen(host_to_runner_w, "wb"), os.fdopen(runner_to_host_r, "rb"))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, args=(runner, serve_args), daemon=True)
        self.thread.start()

    def _serve(self, runner: Runner, serve_args: dict[str, Any]) -> None:
        try:
            serve(runner, stdin=self._runner_in, stdout=self._runner_out, **serve_args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self._runner_out.close()

    def stop(self, timeout: float = TIMEOUT) -> None:
        self.host.close()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "serve() did not return after stdin closed"
        if self.error is not None:
            raise self.error

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Subprocess:
    """A runner script in a child process, stdio piped (stderr captured)."""

    def __init__(self, argv: list[str], cwd: str | None = None, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=dict(env) if env is not None else None,
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.host = FakeHost(self.proc.stdin, self.proc.stdout)
        self._stderr: list[bytes] = []
        self._err_reader = threading.Thread(target=lambda: self._stderr.extend(iter(self.proc.stderr.readline, b"")), daemon=True)  # type: ignore[union-attr]
        self._err_reader.start()

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str]:
        """Closes stdin, waits for the exit; returns (exit code, stderr text)."""
        self.host.close()
        code = self.proc.wait(timeout)
        self._err_reader.join(timeout)
        return code, b"".join(self._stderr).decode("utf-8", "replace")

    @staticmethod
    def python(script: str, **kwargs: Any) -> Subprocess:
        return Subprocess([sys.executable, "-c", script], **kwargs)
