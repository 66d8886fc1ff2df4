"""The SDK against the real host: `switchboard dev` runs the probe runner
(tests/runners/probe_runner.py) in its sandbox; agents are created and messages sent over
the HTTP API, and the streamed replies are checked."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest
from conftest import PER_RUN_ID, PROBE_ID
from sbhost import Event, Switchboard


def agent(sb: Switchboard, name: str, behaviour: str, **fields: Any) -> str:
    """Creates an agent of the probe runner for bot ``name``; returns the bot id."""
    sb.create_agent(name, PROBE_ID, {"behaviour": behaviour}, **fields)
    return name


def reply(events: list[Event]) -> str:
    completed = [e for e in events if e.event == "message.completed"]
    assert completed, events
    return completed[-1].text


def test_a_reply_is_streamed_back(sb: Switchboard) -> None:
    bot = agent(sb, "py-echo", "echo")
    events = sb.send(bot, "hello from the python sdk").rest()
    kinds = [e.event for e in events]
    assert kinds == ["message.delta"] * 5 + ["message.completed", "run.completed"], events
    assert "".join(e.text for e in events if e.event == "message.delta") == "hello from the python sdk"
    assert reply(events) == "hello from the python sdk"
    assert [int(e.id or 0) for e in events] == list(range(1, 8))
    assert len({e.run_id for e in events}) == 1


def test_per_run_mode_serves_each_run_in_a_new_process(sb: Switchboard) -> None:
    sb.create_agent("py-per-run", PER_RUN_ID, {"behaviour": "whoami_pid"})
    pids = []
    for i in range(2):
        events = sb.send("py-per-run", f"run {i}").rest()
        assert [e.event for e in events] == ["message.completed", "run.completed"], events
        pids.append(json.loads(reply(events))["pid"])
    assert pids[0] != pids[1]


def test_host_api_calls(sb: Switchboard) -> None:
    bot = agent(sb, "py-api", "api")
    events = sb.send(bot, "remember this", conversation_id="py-api-conv").rest()
    assert events[-1].event == "run.completed", events
    out = json.loads(reply(events))
    assert out["version"]["host"] == "switchboard" and out["version"]["protocol"] == "v1"
    assert out["version"]["version"]
    assert out["state_set"]["success"] is True
    assert out["state_get"] == {"value": {"n": 1}, "revision": out["state_set"]["revision"]}
    assert isinstance(out["history"]["items"], list)
    assert out["storage"] == list(b"\x00\x01binary")
    assert "probe.bytes" in out["storage_keys"]


def test_host_api_errors_carry_their_code(sb: Switchboard) -> None:
    bot = agent(sb, "py-errors", "error")
    out = json.loads(reply(sb.send(bot, "go").rest()))
    assert out["call_tool"]["code"] == "unauthorized"
    assert out["call_tool"]["message"] == "no tool is authorized for operation call for this agent run"
    assert out["call_tool"]["retryable"] is False
    assert out["history_search"]["code"] == "unauthorized"  # the manifest asks for history page only
    assert out["unknown_action"]["code"] == "not_found"
    assert out["bad_scope"]["code"] == "unauthorized"


def test_an_uncaught_host_api_error_fails_the_run(sb: Switchboard) -> None:
    bot = agent(sb, "py-fail", "fail_on_error")
    events = sb.send(bot, "go").rest()
    terminal = events[-1]
    assert terminal.event == "run.failed", events
    assert terminal.data["data"]["code"] == "runner.error"
    assert "host api error unauthorized" in terminal.data["data"]["error"]


def test_cancel_reaches_the_runner(sb: Switchboard) -> None:
    bot = agent(sb, "py-cancel", "cancel")
    stream = sb.send(bot, "wait")
    first = stream.next()
    assert first.text == "waiting for cancel", first
    started = time.monotonic()
    answer = sb.cancel(str(first.run_id), "stop it")
    assert answer["cancelled"] is True, answer
    events = stream.rest()
    assert [e.event for e in events] == ["message.delta", "message.delta", "run.failed"], events
    assert events[1].text == "cancel seen: stop it", events
    failed = events[-1].data["data"]
    assert failed["code"] == "cancelled"
    # The runner's own terminal result, well before the host's cancel grace period (5 s).
    assert time.monotonic() - started < 4


def test_two_concurrent_runs_in_one_shared_process(sb: Switchboard) -> None:
    bot = agent(sb, "py-barrier", "barrier")
    outcomes: dict[int, list[Event]] = {}

    def send(i: int) -> None:
        outcomes[i] = sb.send(bot, f"run {i}").rest()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(outcomes) == {0, 1}
    replies = [json.loads(reply(outcomes[i])) for i in range(2)]
    # Both runs passed a two-party barrier: they were in flight at once, in the same process.
    assert replies[0]["pid"] == replies[1]["pid"], replies
    assert sorted(r["arrival"] for r in replies) == [0, 1]
    assert outcomes[0][-1].run_id != outcomes[1][-1].run_id


def test_stray_print_goes_to_the_log_not_the_protocol(sb: Switchboard) -> None:
    bot = agent(sb, "py-print", "stray_print")
    events = sb.send(bot, "print something").rest()
    assert [e.event for e in events] == ["message.completed", "run.completed"], events
    run_id = events[0].run_id
    deadline = time.monotonic() + 10
    while f"stray print from {run_id}" not in sb.log():
        assert time.monotonic() < deadline, "the runner's print() did not reach the worker log"
        time.sleep(0.1)
    log = sb.log()
    assert "stray sys.stdout write" in log and "stray fd 1 write" in log
    assert "unusable line from runner" not in log


def test_runner_process_is_sandboxed(sb: Switchboard) -> None:
    bot = agent(sb, "py-whoami", "whoami")
    out = json.loads(reply(sb.send(bot, "who").rest()))
    if os.geteuid() == 0:
        assert out["uid"] != 0  # `nobody`: the worker never runs plugin code as root
    assert out["cwd"].endswith("/py-probe")
    assert "SWITCHBOARD_TEST_DATABASE_URL" not in out["env"] and "PATH" not in out["env"]


class FakeModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible streaming chat endpoint answering "Hello" in two chunks."""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta, finish in (({"role": "assistant", "content": "Hel"}, None), ({"content": "lo"}, None), ({}, "stop")):
            chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def fake_model() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def test_invoke_llm_stream_yields_the_models_chunks(sb: Switchboard, fake_model: str) -> None:
    model = sb.request("POST", "/v1/models", {"name": "fake", "kind": "llm", "base_url": fake_model, "model_name": "fake-1"})
    bot = agent(sb, "py-stream", "stream", resource_policy={"allowed_model_uuids": [model["model_id"]]})
    events = sb.send(bot, "say hello").rest()
    assert events[-1].event == "run.completed", (events, sb.log()[-3000:])
    assert [e.text for e in events if e.event == "message.delta"] == ["Hel", "lo"]
    final = json.loads(reply(events))["final"]
    assert final["message"]["content"] == "Hello"
