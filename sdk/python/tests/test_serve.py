"""The serve loop against a scripted host: sequencing, demultiplexing, cancel, shutdown."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest
from fakehost import InProcess, make_context

from switchboard_runner import (
    AgentAPIException,
    AgentRunner,
    HostApiError,
    RunContext,
    RunFailed,
    parse_context,
    results,
)


class Echo(AgentRunner):
    def run(self, ctx: RunContext) -> None:
        for word in ctx.input_text.split():
            ctx.emit.message_delta(word)
        ctx.emit.message_completed(ctx.input_text)
        ctx.emit.run_completed()


def test_results_are_sequenced_and_the_run_ends_with_done() -> None:
    with InProcess(Echo()) as p:
        p.host.run("r1", make_context("r1", "a b c"))
        got = p.host.results("r1")
    assert [r["type"] for r in got] == ["message.delta"] * 3 + ["message.completed", "run.completed"]
    assert [r["sequence"] for r in got] == [1, 2, 3, 4, 5]
    assert {r["run_id"] for r in got} == {"r1"}
    assert got[0]["data"] == {"chunk": {"role": "assistant", "content": "a"}}


def test_context_fields_are_typed() -> None:
    seen: dict[str, Any] = {}

    def run(ctx: RunContext) -> None:
        seen.update(
            run_id=ctx.run_id,
            runner=ctx.runner_id,
            event=ctx.event.event_id,
            trigger=ctx.trigger.type,
            conversation=ctx.conversation.conversation_id if ctx.conversation else None,
            text=ctx.input.text,
            history=ctx.context.available_apis.history_page,
            steering=ctx.context.available_apis.steering_pull,
            plugin_storage=ctx.resources.storage.plugin_storage,
            metadata=ctx.runtime.metadata,
            raw=ctx.raw["delivery"]["surface"],
        )
        ctx.emit.message_completed("ok")

    with InProcess(run) as p:
        p.host.run("r1", runner="plugin:a/b/default")
        assert [r["type"] for r in p.host.results("r1")] == ["message.completed"]
    assert seen == {
        "run_id": "r1",
        "runner": "plugin:a/b/default",
        "event": "e-r1",
        "trigger": "message.received",
        "conversation": "c1",
        "text": "hello",
        "history": True,
        "steering": False,
        "plugin_storage": True,
        "metadata": {"k": "v"},
        "raw": "api",
    }


def test_parse_context_is_lenient() -> None:
    ctx = parse_context({"run_id": "x", "input": None, "future_field": 1, "runtime": {"deadline_at": 5}})
    assert ctx.input.text is None and ctx.input.contents == []
    assert ctx.runtime.deadline_at == 5.0
    assert ctx.conversation is None


def test_api_answers_are_routed_by_call_id_across_concurrent_runs() -> None:
    barrier = threading.Barrier(2, timeout=10)

    def run(ctx: RunContext) -> None:
        barrier.wait()
        answer = ctx.api.get_host_version()
        ctx.emit.message_completed(f"{ctx.run_id}:{answer['version']}")

    with InProcess(run) as p:
        p.host.run("ra")
        p.host.run("rb")
        calls = [p.host.expect(lambda m: m["op"] == "api") for _ in range(2)]
        assert {c["run_id"] for c in calls} == {"ra", "rb"}
        assert all(c["action"] == "get_host_version" and c["params"] == {} for c in calls)
        assert calls[0]["id"] != calls[1]["id"]
        # Answer in reverse order; each run gets its own answer.
        for call in reversed(calls):
            p.host.send({"op": "api_result", "id": call["id"], "ok": True, "data": {"version": "v-" + call["run_id"]}})
        texts = {}
        for run_id in ("ra", "rb"):
            (item,) = p.host.results(run_id)
            texts[run_id] = item["data"]["message"]["content"]
    assert texts == {"ra": "ra:v-ra", "rb": "rb:v-rb"}


def test_streamed_answer_yields_chunks_then_the_result() -> None:
    def run(ctx: RunContext) -> None:
        stream = ctx.api.invoke_llm_stream("m1", [{"role": "user", "content": "hi"}])
        for chunk in stream:
            ctx.emit.message_delta(chunk["content"])
        assert stream.result is not None
        ctx.emit.message_completed(stream.result["message"]["content"])

    with InProcess(run) as p:
        p.host.run("r1")
        call = p.host.expect(lambda m: m["op"] == "api")
        assert call["action"] == "invoke_llm_stream"
        assert call["params"] == {"llm_model_uuid": "m1", "messages": [{"role": "user", "content": "hi"}]}
        # A chunk for an unknown call id is ignored.
        p.host.send({"op": "api_chunk", "id": "999", "data": {"chunk": {"content": "zz"}}})
        for part in ("he", "llo"):
            p.host.send({"op": "api_chunk", "id": call["id"], "data": {"chunk": {"role": "assistant", "content": part}}})
        p.host.send({"op": "api_result", "id": call["id"], "ok": True, "data": {"message": {"role": "assistant", "content": "hello"}, "usage": {}}})
        got = p.host.results("r1")
    assert [(r["type"], r["data"]) for r in got] == [
        ("message.delta", {"chunk": {"role": "assistant", "content": "he"}}),
        ("message.delta", {"chunk": {"role": "assistant", "content": "llo"}}),
        ("message.completed", {"message": {"role": "assistant", "content": "hello"}}),
    ]


def test_host_errors_raise_host_api_error_with_the_protocol_fields() -> None:
    caught: list[HostApiError] = []

    def run(ctx: RunContext) -> None:
        try:
            ctx.api.call_tool("nope", {"x": 1})
        except AgentAPIException as e:  # the seed's name for HostApiError
            caught.append(e)
        ctx.api.state_get("conversation", "k")  # uncaught: fails the run

    with InProcess(run) as p:
        p.host.run("r1")
        call = p.host.expect(lambda m: m["op"] == "api")
        assert call["params"] == {"tool_name": "nope", "parameters": {"x": 1}}
        error = {"code": "unauthorized", "message": "no tool", "retryable": False, "details": {"tool": "nope"}}
        p.host.send({"op": "api_result", "id": call["id"], "ok": False, "error": error})
        call = p.host.expect(lambda m: m["op"] == "api")
        p.host.send({"op": "api_result", "id": call["id"], "ok": False, "error": {"code": "rate_limited", "message": "slow down", "retryable": True}})
        (failed,) = p.host.results("r1")
    (e,) = caught
    assert (e.code, e.message, e.retryable, e.details) == ("unauthorized", "no tool", False, {"tool": "nope"})
    assert e.error.to_dict() == error
    assert failed["type"] == "run.failed"
    assert failed["data"] == {"code": "runner.error", "error": "host api error rate_limited: slow down", "retryable": True}


def test_malformed_error_answer_still_raises() -> None:
    assert HostApiError.from_wire("oops").code == "runtime_error"
    assert HostApiError.from_wire({"message": "m"}).code == "runtime_error"


def test_cancel_wakes_the_run_and_fails_its_pending_calls() -> None:
    outcome: dict[str, Any] = {}

    def run(ctx: RunContext) -> None:
        ctx.emit.message_delta("waiting")
        try:
            ctx.api.call("slow_action", {})
        except HostApiError as e:
            outcome["code"] = e.code
        outcome["woke"] = ctx.wait_cancelled(10)
        outcome["reason"] = ctx.cancel_reason

    with InProcess(run) as p:
        p.host.run("r1")
        p.host.expect(lambda m: m["op"] == "api")
        p.host.send({"op": "cancel", "run_id": "r1", "reason": "user"})
        got = p.host.results("r1")
    assert outcome == {"code": "cancelled", "woke": True, "reason": "user"}
    assert [r["type"] for r in got] == ["message.delta", "run.failed"]
    assert got[1]["data"]["code"] == "cancelled"


def test_generator_runs_are_drained_and_stopped_on_cancel() -> None:
    stopped = threading.Event()

    class Gen(AgentRunner):
        def run(self, ctx: RunContext) -> Iterator[dict[str, Any]]:
            try:
                n = 0
                while True:
                    n += 1
                    yield results.message_delta(str(n))
                    ctx.wait_cancelled(0.01)
            finally:
                stopped.set()

    with InProcess(Gen()) as p:
        p.host.run("r1")
        p.host.expect(lambda m: m["op"] == "result")
        p.host.send({"op": "cancel", "run_id": "r1", "reason": "enough"})
        got = p.host.results("r1")
    assert stopped.wait(5)
    assert got[-1]["type"] == "run.failed" and got[-1]["data"]["code"] == "cancelled"


def test_async_runs_are_supported() -> None:
    async def run(ctx: RunContext) -> None:
        ctx.emit.message_completed("async " + ctx.input_text)

    with InProcess(run) as p:
        p.host.run("r1")
        (item,) = p.host.results("r1")
    assert item["data"]["message"]["content"] == "async hello"


def test_exceptions_become_run_failed() -> None:
    def run(ctx: RunContext) -> None:
        if ctx.input_text == "custom":
            raise RunFailed("nope", code="runner.custom", retryable=True)
        if ctx.input_text == "after":
            ctx.emit.run_completed()
            raise ValueError("late")
        raise ValueError("boom")

    with InProcess(run) as p:
        for run_id, text in (("r1", "x"), ("r2", "custom"), ("r3", "after")):
            p.host.run(run_id, make_context(run_id, text))
        got = {run_id: p.host.results(run_id) for run_id in ("r1", "r2", "r3")}
    assert got["r1"][0]["data"] == {"code": "runner.error", "error": "ValueError: boom", "retryable": False}
    assert got["r2"][0]["data"] == {"code": "runner.custom", "error": "nope", "retryable": True}
    # A terminal result already written wins: nothing after it.
    assert [r["type"] for r in got["r3"]] == ["run.completed"]


def test_emitting_after_the_terminal_result_raises() -> None:
    errors: list[str] = []

    def run(ctx: RunContext) -> None:
        ctx.emit.run_completed()
        try:
            ctx.emit.message_delta("late")
        except Exception as e:  # RunFinished
            errors.append(type(e).__name__)

    with InProcess(run) as p:
        p.host.run("r1")
        assert [r["type"] for r in p.host.results("r1")] == ["run.completed"]
    assert errors == ["RunFinished"]


def test_deadline_bounds_api_calls() -> None:
    codes: list[str] = []

    def run(ctx: RunContext) -> None:
        try:
            ctx.api.ping()
        except HostApiError as e:
            codes.append(e.code)
        ctx.emit.message_completed("done")

    with InProcess(run) as p:
        context = make_context("r1")
        context["runtime"]["deadline_at"] = time.time() + 0.3
        p.host.run("r1", context)
        p.host.expect(lambda m: m["op"] == "api")
        p.host.results("r1")
    assert codes == ["deadline_exceeded"]


def test_bad_host_lines_are_reported_and_skipped() -> None:
    with InProcess(Echo()) as p:
        p.host.send_raw(b"this is not json\n\n[1]\n")
        p.host.send({"op": "teleport"})
        logs = [p.host.expect(lambda m: m["op"] == "log") for _ in range(3)]
        assert all(m["level"] in ("error", "warn") for m in logs)
        p.host.run("r1")
        assert p.host.results("r1")[-1]["type"] == "run.completed"


def test_shutdown_refuses_new_runs_and_serve_returns_at_eof() -> None:
    release = threading.Event()

    def run(ctx: RunContext) -> None:
        release.wait(10)
        ctx.emit.message_completed("finished")

    p = InProcess(run)
    p.host.run("r1")
    time.sleep(0.1)
    p.host.send({"op": "shutdown"})
    p.host.run("r2")
    refused = p.host.results("r2")
    assert refused[0]["type"] == "run.failed" and refused[0]["data"]["retryable"] is True
    release.set()
    assert p.host.results("r1")[0]["data"]["message"]["content"] == "finished"
    p.thread.join(5)
    assert not p.thread.is_alive(), "serve() returns once shut down and idle"
    p.stop()


def test_eof_cancels_in_flight_runs_after_the_grace_period() -> None:
    seen: list[str | None] = []

    def run(ctx: RunContext) -> None:
        try:
            ctx.api.call("never_answered", {})
        except HostApiError as e:
            seen.append(e.code)
        ctx.wait_cancelled(10)
        seen.append(ctx.cancel_reason)

    p = InProcess(run, eof_grace=0.2, cancel_grace=5)
    p.host.run("r1")
    p.host.expect(lambda m: m["op"] == "api")
    started = time.monotonic()
    p.stop()
    assert time.monotonic() - started < 5
    assert seen == ["unavailable", "host connection closed"]


@pytest.mark.parametrize("bad_context", [None, "x"])
def test_a_run_without_context_fails_instead_of_hanging(bad_context: Any) -> None:
    with InProcess(Echo()) as p:
        p.host.send({"op": "run", "run_id": "r1", "runner": "plugin:a/b/c", "context": bad_context})
        (failed,) = p.host.results("r1")
    assert failed["type"] == "run.failed"


def test_a_mapping_serves_several_runners_of_a_plugin() -> None:
    runners = {
        "one": lambda ctx: ctx.emit.message_completed("one"),
        "plugin:a/b/two": lambda ctx: ctx.emit.message_completed("two"),
    }
    with InProcess(runners) as p:
        p.host.run("r1", runner="plugin:a/b/one")
        p.host.run("r2", runner="plugin:a/b/two")
        p.host.run("r3", runner="plugin:a/b/three")
        assert p.host.results("r1")[0]["data"]["message"]["content"] == "one"
        assert p.host.results("r2")[0]["data"]["message"]["content"] == "two"
        assert p.host.results("r3")[0]["type"] == "run.failed"


def test_many_runs_with_interleaved_calls_are_demultiplexed() -> None:
    import queue
    import random

    runs, calls_per_run = 20, 5

    def run(ctx: RunContext) -> None:
        for i in range(calls_per_run):
            answer = ctx.api.call("echo", {"run": ctx.run_id, "i": i})
            assert answer == {"run": ctx.run_id, "i": i}, answer
            ctx.emit.message_delta(str(i))
        ctx.emit.run_completed()

    with InProcess(run) as p:
        for n in range(runs):
            p.host.run(f"r{n}")
        answered = 0
        rng = random.Random(7)
        pending: list[dict[str, Any]] = []
        while answered < runs * calls_per_run:
            try:
                pending.append(p.host.expect(lambda m: m["op"] == "api", timeout=0.2))
                flush = len(pending) > 5
            except queue.Empty:  # every run waits on a pending call: answer them all
                flush = True
            # Answer pending calls in random order (out of order across runs).
            rng.shuffle(pending)
            while pending and (flush or rng.random() < 0.3):
                call = pending.pop()
                p.host.send({"op": "api_result", "id": call["id"], "ok": True, "data": call["params"]})
                answered += 1
        for n in range(runs):
            got = p.host.results(f"r{n}")
            assert [r["type"] for r in got] == ["message.delta"] * calls_per_run + ["run.completed"]
            assert [r["sequence"] for r in got] == list(range(1, calls_per_run + 2))
