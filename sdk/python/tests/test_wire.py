"""Framing: one JSON object per line, both directions."""

from __future__ import annotations

import io
import json
import threading

import pytest

from switchboard_runner import EmitError, results
from switchboard_runner.wire import Output, WireError, decode_line, encode_line


def test_encode_is_one_compact_utf8_line() -> None:
    line = encode_line({"op": "log", "level": "info", "message": "a\nb — ü"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert b" " not in line.replace("a\\nb — ü".encode(), b"")
    assert json.loads(line) == {"op": "log", "level": "info", "message": "a\nb — ü"}
    assert "ü".encode() in line  # not \u-escaped


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": float("inf")}, {"x": object()}])
def test_encode_refuses_what_the_host_cannot_parse(bad: dict) -> None:
    with pytest.raises(EmitError):
        encode_line(bad)


def test_encode_refuses_lines_over_the_cap() -> None:
    assert encode_line({"x": "y" * 10}, max_bytes=100)
    with pytest.raises(EmitError, match="exceeds the line limit"):
        encode_line({"x": "y" * 200}, max_bytes=100)


def test_decode() -> None:
    assert decode_line(b'{"op":"shutdown"}\n') == {"op": "shutdown"}
    for bad in (b"not json", b"[1,2]", b'"s"', b"\xff\xfe"):
        with pytest.raises(WireError):
            decode_line(bad)


def test_output_writes_whole_lines_from_many_threads() -> None:
    buf = io.BytesIO()
    out = Output(buf)
    payload = "x" * 5000

    def write(n: int) -> None:
        for i in range(50):
            out.log("info", f"{n}:{i}:{payload}")

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 400
    for line in lines:
        assert json.loads(line)["message"].endswith(payload)


def test_result_builders_use_the_protocol_names_and_shapes() -> None:
    assert [r for r in results.RESULT_TYPES] == [
        "message.delta",
        "message.completed",
        "tool.call.started",
        "tool.call.completed",
        "artifact.created",
        "state.updated",
        "action.requested",
        "run.completed",
        "run.failed",
    ]
    assert results.message_delta("hel") == {
        "type": "message.delta",
        "data": {"chunk": {"role": "assistant", "content": "hel"}},
    }
    assert results.message_completed("hello") == {
        "type": "message.completed",
        "data": {"message": {"role": "assistant", "content": "hello"}},
    }
    assert results.tool_call_started("c1", "search", {"q": "x"})["data"] == {
        "tool_call_id": "c1",
        "tool_name": "search",
        "parameters": {"q": "x"},
    }
    assert results.tool_call_completed("c1", "search", {"n": 1})["data"] == {
        "tool_call_id": "c1",
        "tool_name": "search",
        "result": {"n": 1},
        "error": None,
    }
    assert results.artifact_created("file", content=b"hi", name="a.txt", mime_type="text/plain")["data"] == {
        "artifact_type": "file",
        "content_base64": "aGk=",
        "size_bytes": 2,
        "name": "a.txt",
        "mime_type": "text/plain",
    }
    assert results.state_updated("conversation", "k", [1]) == {
        "type": "state.updated",
        "data": {"scope": "conversation", "key": "k", "value": [1]},
    }
    assert results.action_requested("message.edit", {"message_id": "m"})["data"] == {
        "action": "message.edit",
        "target": {"message_id": "m"},
    }
    assert results.run_completed()["data"] == {"finish_reason": "stop"}
    assert results.run_completed("stop", "bye")["data"]["message"] == {"role": "assistant", "content": "bye"}
    assert results.run_failed("boom")["data"] == {"code": "runner.error", "error": "boom", "retryable": False}
