"""The runner main loop: :func:`serve`.

One reader thread reads the host's lines and demultiplexes them: ``run`` starts the run on
a thread of its own, ``cancel`` flags a run (and fails its in-flight Host API calls),
``api_result`` / ``api_chunk`` go to the call waiting for their ``id``, ``shutdown`` stops
new runs. So one process serves many runs at once (manifest ``mode = "shared"``) as well as
one run per process (``mode = "per_run"``).

When a run's ``run`` returns the SDK finishes it: an exception becomes ``run.failed``
(unless a terminal result was already written), a return after a cancel becomes
``run.failed {code: "cancelled"}``, and ``done`` is always sent. A run that wrote messages
but no terminal result is completed by the host (``finish_reason: "stop"``); one that wrote
nothing at all is failed by the host (``runner.empty_output``).
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import io
import os
import sys
import threading
import time
import traceback
from typing import IO, Any, AsyncIterable, Awaitable, Callable, Iterable, Mapping, Optional, Union

from .api import ApiRouter, HostApi
from .context import RunContext
from .emit import Emitter
from .errors import EmitError, ErrorCode, HostApiError, RunFailed, RunFailure, RunFinished
from .wire import MAX_LINE_BYTES, Output, WireError, decode_line

__all__ = ["AgentRunner", "RunOutput", "Runner", "serve"]

#: What ``run`` may return: nothing (it emitted through ``ctx.emit``), results to emit (one
#: ``AgentRunResult`` dict, or a list or generator of them, sync or async), or the coroutine
#: of an ``async def run``.
RunOutput = Optional[
    Union[Iterable[Mapping[str, Any]], AsyncIterable[Mapping[str, Any]], Mapping[str, Any], Awaitable[Any]]
]


class AgentRunner(abc.ABC):
    """A runner: one instance serves every run of the process, concurrently.

    Contract of :meth:`run`: write results in order through ``ctx.emit`` (or yield them),
    end with ``run.completed`` / ``run.failed`` (or raise, or just return), and check
    ``ctx.cancelled`` in long loops. Returning is the end of the run.
    """

    @abc.abstractmethod
    def run(self, ctx: RunContext) -> RunOutput:
        """Executes one run (on its own thread)."""


#: Anything :func:`serve` accepts: an :class:`AgentRunner`, a function ``run(ctx)``, or a
#: mapping from runner name (or full runner id) to either, for a plugin with several runners.
Runner = Union[AgentRunner, Callable[[RunContext], RunOutput], Mapping[str, Union[AgentRunner, Callable[[RunContext], RunOutput]]]]


def serve(
    runner: Runner,
    *,
    stdin: IO[bytes] | None = None,
    stdout: IO[bytes] | None = None,
    eof_grace: float = 30.0,
    cancel_grace: float = 5.0,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> None:
    """Serves runs until the host sends ``shutdown`` (and every run ended) or closes stdin.

    Without ``stdin``/``stdout`` it serves the process's own stdio, and first moves it out
    of reach of runner code: the protocol keeps private duplicates of file descriptors 0
    and 1, then descriptor 1 (and ``sys.stdout``) is pointed at stderr and descriptor 0 at
    ``/dev/null``. A stray ``print()`` — or a child process writing to its inherited stdout —
    therefore lands in the worker's log instead of corrupting the protocol stream.

    After stdin closes, in-flight runs get ``eof_grace`` seconds, are then cancelled, and
    get ``cancel_grace`` more before :func:`serve` returns.
    """
    if stdin is None or stdout is None:
        proto_in, proto_out = _isolate_stdio()
        stdin = stdin or proto_in
        stdout = stdout or proto_out
    server = _Server(runner, stdin, Output(stdout, max_line_bytes))
    server.serve(eof_grace, cancel_grace)


def _isolate_stdio() -> tuple[IO[bytes], IO[bytes]]:
    for stream in (sys.stdout, sys.__stdout__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)))
    return proto_in, proto_out


class _Run:
    __slots__ = ("ctx", "thread")

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.thread: threading.Thread | None = None


class _Server:
    def __init__(self, runner: Runner, stdin: IO[bytes], output: Output) -> None:
        self._runner = runner
        self._in = stdin
        self._out = output
        self._router = ApiRouter(output)
        self._cond = threading.Condition()
        self._runs: dict[str, _Run] = {}
        self._closing = False
        self._input_ended = False

    # Main thread ----------------------------------------------------------------------

    def serve(self, eof_grace: float, cancel_grace: float) -> None:
        reader = threading.Thread(target=self._read_loop, name="switchboard-reader", daemon=True)
        reader.start()
        with self._cond:
            while not (self._closing and not self._runs):
                if self._input_ended:
                    break
                self._cond.wait()
        if self._input_ended:
            # Nobody answers API calls or sends cancels any more: a grace period, then cancel.
            self._wait_runs(eof_grace)
            with self._cond:
                runs = list(self._runs.values())
            for run in runs:
                run.ctx._mark_cancelled("host connection closed")
            self._wait_runs(cancel_grace)
        reader.join(timeout=0.1)

    def _wait_runs(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._runs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    # Reader thread --------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    line = self._in.readline()
                except (OSError, ValueError):
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    message = decode_line(line)
                except WireError as e:
                    self._log("error", f"unusable host line ignored: {e}")
                    continue
                try:
                    self._handle(message)
                except Exception:  # a bug here must not stop the reader
                    traceback.print_exc(file=sys.stderr)
        finally:
            self._router.close(HostApiError(ErrorCode.UNAVAILABLE, "host connection closed", retryable=True))
            with self._cond:
                self._closing = True
                self._input_ended = True
                self._cond.notify_all()

    def _handle(self, message: Mapping[str, Any]) -> None:
        op = message.get("op")
        if op == "run":
            self._start_run(message)
        elif op == "cancel":
            run_id = message.get("run_id")
            reason = message.get("reason")
            with self._cond:
                run = self._runs.get(run_id) if isinstance(run_id, str) else None
            if run is not None:
                text = reason if isinstance(reason, str) and reason else "cancelled"
                run.ctx._mark_cancelled(text)
                self._router.fail_run(run.ctx.run_id, HostApiError(ErrorCode.CANCELLED, f"run was cancelled: {text}"))
        elif op == "api_result":
            self._router.route_result(message)
        elif op == "api_chunk":
            self._router.route_chunk(message)
        elif op == "shutdown":
            with self._cond:
                self._closing = True
                self._cond.notify_all()
        else:
            self._log("warn", f"host message with unknown op {op!r} ignored")

    def _start_run(self, message: Mapping[str, Any]) -> None:
        run_id = message.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            self._log("error", "run message without a run_id ignored")
            return
        runner_id = message.get("runner")
        runner_id = runner_id if isinstance(runner_id, str) else ""
        context = message.get("context")
        emitter = Emitter(run_id, self._out)
        if not isinstance(context, Mapping):
            self._refuse(emitter, "run message without a context object", retryable=False)
            return
        impl = self._pick(runner_id)
        if impl is None:
            self._refuse(emitter, f"this process serves no runner {runner_id!r}", retryable=False)
            return
        cancel = threading.Event()
        deadline = _deadline_of(context)
        try:
            ctx = RunContext(run_id, runner_id, context, emitter, HostApi(run_id, self._router, cancel, deadline), cancel)
        except Exception as e:  # a context this SDK cannot read: fail the run, do not hang it
            self._refuse(emitter, f"invalid run context: {type(e).__name__}: {e}", retryable=False)
            return
        run = _Run(ctx)
        with self._cond:
            if self._closing:
                refuse = "runner is shutting down"
            elif run_id in self._runs:
                # A duplicate would mix two result streams; the first run wins.
                self._log("error", f"duplicate run {run_id} ignored", run_id)
                return
            else:
                refuse = None
                self._runs[run_id] = run
        if refuse is not None:
            self._refuse(emitter, refuse, retryable=True)
            return
        thread = threading.Thread(target=self._execute, args=(impl, run), name=f"run-{run_id}", daemon=True)
        run.thread = thread
        try:
            thread.start()
        except RuntimeError as e:  # cannot start a new thread
            self._finish(run)
            self._refuse(emitter, f"cannot start run thread: {e}", retryable=True)

    def _pick(self, runner_id: str) -> Callable[[RunContext], RunOutput] | None:
        chosen: Any = self._runner
        if isinstance(chosen, Mapping):
            name = runner_id.rsplit("/", 1)[-1]
            chosen = chosen.get(runner_id) or chosen.get(name)
        if chosen is None:
            return None
        run = getattr(chosen, "run", None)
        if callable(run):
            return run  # type: ignore[no-any-return]
        return chosen if callable(chosen) else None

    def _refuse(self, emitter: Emitter, reason: str, retryable: bool) -> None:
        try:
            emitter.run_failed(reason, RunFailure.RUNNER_ERROR, retryable)
            emitter.done()
        except EmitError:
            pass

    def _finish(self, run: _Run) -> None:
        with self._cond:
            self._runs.pop(run.ctx.run_id, None)
            self._cond.notify_all()

    # Run threads ----------------------------------------------------------------------

    def _execute(self, impl: Callable[[RunContext], RunOutput], run: _Run) -> None:
        ctx = run.ctx
        emit = ctx.emit
        failure: RunFailed | None = None
        try:
            out = impl(ctx)
            if inspect.iscoroutine(out):
                out = asyncio.run(out)
            if inspect.isasyncgen(out):
                asyncio.run(_drain_async(out, ctx))
            elif out is not None:
                _drain(out, ctx)
            if ctx.cancelled:
                failure = RunFailed(f"run cancelled: {ctx.cancel_reason or 'cancelled'}", RunFailure.CANCELLED)
        except RunFailed as e:
            failure = e
        except HostApiError as e:
            failure = _api_failure(e)
        except RunFinished as e:
            print(f"switchboard_runner: run {ctx.run_id}: {e}", file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 - every way out of run ends the run
            traceback.print_exc(file=sys.stderr)
            failure = RunFailed(f"{type(e).__name__}: {e}", RunFailure.RUNNER_ERROR)
        try:
            if failure is not None and not emit.finished:
                emit.run_failed(failure.message, failure.code, failure.retryable)
        except EmitError:
            pass
        try:
            emit.done()
        except EmitError:
            pass
        finally:
            self._finish(run)

    def _log(self, level: str, message: str, run_id: str | None = None) -> None:
        try:
            self._out.log(level, message, run_id)
        except EmitError:
            print(f"switchboard_runner: {message}", file=sys.stderr)


def _deadline_of(context: Mapping[str, Any]) -> float | None:
    runtime = context.get("runtime")
    value = runtime.get("deadline_at") if isinstance(runtime, Mapping) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _api_failure(e: HostApiError) -> RunFailed:
    """A Host API failure that ends the run: ``cancelled`` stays ``cancelled``, a passed
    deadline becomes ``timeout``, anything else ``runner.error`` naming the API code."""
    if e.code == ErrorCode.CANCELLED:
        return RunFailed(e.message, RunFailure.CANCELLED)
    if e.code == ErrorCode.DEADLINE_EXCEEDED:
        return RunFailed(e.message, RunFailure.TIMEOUT, retryable=True)
    return RunFailed(f"host api error {e.code}: {e.message}", RunFailure.RUNNER_ERROR, e.retryable)


def _emit_item(item: Any, ctx: RunContext) -> None:
    if not isinstance(item, Mapping):
        raise EmitError(f"run yielded {type(item).__name__}, expected an AgentRunResult dict")
    ctx.emit.emit(item)


def _drain(out: Any, ctx: RunContext) -> None:
    if isinstance(out, Mapping):
        _emit_item(out, ctx)
        return
    iterator = iter(out)
    try:
        for item in iterator:
            _emit_item(item, ctx)
            if ctx.emit.finished or ctx.cancelled:
                break
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()


async def _drain_async(out: Any, ctx: RunContext) -> None:
    try:
        async for item in out:
            _emit_item(item, ctx)
            if ctx.emit.finished or ctx.cancelled:
                break
    finally:
        await out.aclose()
