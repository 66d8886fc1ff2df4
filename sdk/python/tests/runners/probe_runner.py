"""The end-to-end suite's runner (switchboard-runner SDK), copied into a plugin directory
that `switchboard dev --runners-dir` loads. What a run does is its agent's
`runner_config.behaviour`; every reply is one `message.completed` (JSON where it reports).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from switchboard_runner import AgentRunner, HostApiError, RunContext, serve

# Two runs meet here; only runs that are in flight at the same time in this one process can.
BARRIER = threading.Barrier(2, timeout=30)


def report(e: HostApiError) -> dict[str, Any]:
    return {"code": e.code, "message": e.message, "retryable": e.retryable, "details": e.details}


class Probe(AgentRunner):
    def run(self, ctx: RunContext) -> None:
        behaviour = ctx.config.get("behaviour", "echo")
        getattr(self, behaviour)(ctx)

    def echo(self, ctx: RunContext) -> None:
        words = ctx.input_text.split()
        for i, word in enumerate(words):
            ctx.emit.message_delta(word if i == 0 else " " + word)
        ctx.emit.message_completed(ctx.input_text)
        ctx.emit.run_completed()

    def api(self, ctx: RunContext) -> None:
        out: dict[str, Any] = {"version": ctx.api.get_host_version()}
        out["state_set"] = ctx.api.state_set("conversation", "probe.counter", {"n": 1})
        out["state_get"] = ctx.api.state_get("conversation", "probe.counter")
        out["history"] = ctx.api.history_page(limit=10)
        ctx.api.set_plugin_storage("probe.bytes", b"\x00\x01binary")
        out["storage"] = list(ctx.api.get_plugin_storage("probe.bytes"))
        out["storage_keys"] = ctx.api.get_plugin_storage_keys()
        ctx.emit.message_completed(json.dumps(out))

    def error(self, ctx: RunContext) -> None:
        out: dict[str, Any] = {}
        for name, call in (
            ("call_tool", lambda: ctx.api.call_tool("no-such-tool", {})),
            ("history_search", lambda: ctx.api.history_search("anything")),
            ("unknown_action", lambda: ctx.api.call("teleport", {})),
            ("bad_scope", lambda: ctx.api.state_get("galaxy", "k")),
        ):
            try:
                out[name] = {"ok": call()}
            except HostApiError as e:
                out[name] = report(e)
        ctx.emit.message_completed(json.dumps(out))

    def fail_on_error(self, ctx: RunContext) -> None:
        ctx.emit.message_delta("calling")
        ctx.api.call_tool("no-such-tool", {})  # uncaught: the SDK fails the run

    def stream(self, ctx: RunContext) -> None:
        model = ctx.resources.models[0].model_id
        stream = ctx.api.invoke_llm_stream(model, [{"role": "user", "content": ctx.input_text}])
        for chunk in stream:
            ctx.emit.message_delta(chunk["content"])
        ctx.emit.message_completed(json.dumps({"final": stream.result}))

    def cancel(self, ctx: RunContext) -> None:
        ctx.emit.message_delta("waiting for cancel")
        if ctx.wait_cancelled(60):
            ctx.emit.message_delta(f"cancel seen: {ctx.cancel_reason}")
        # Returning after a cancel: the SDK ends the run with run.failed {code: "cancelled"}.

    def barrier(self, ctx: RunContext) -> None:
        index = BARRIER.wait()
        ctx.emit.message_completed(json.dumps({"pid": os.getpid(), "arrival": index}))

    def stray_print(self, ctx: RunContext) -> None:
        print(f"stray print from {ctx.run_id}")
        sys.stdout.write("stray sys.stdout write\n")
        os.write(1, b"stray fd 1 write\n")
        ctx.emit.message_completed("printed")

    def whoami_pid(self, ctx: RunContext) -> None:
        ctx.emit.message_completed(json.dumps({"pid": os.getpid()}))

    def whoami(self, ctx: RunContext) -> None:
        ctx.emit.message_completed(json.dumps({"uid": os.getuid(), "cwd": os.getcwd(), "env": sorted(os.environ)}))


if __name__ == "__main__":
    serve(Probe())
