"""Write Switchboard agent runners in Python.

A runner is a process that the Switchboard worker starts and talks to over stdin/stdout,
one JSON object per line (AgentRunner Protocol v1, ``docs/RUNNERS.md``). This package
implements that wire, so a runner only implements ``run(self, ctx)``::

    from switchboard_runner import AgentRunner, RunContext, serve

    class Shout(AgentRunner):
        def run(self, ctx: RunContext) -> None:
            text = ctx.input_text.upper()
            ctx.emit.message_delta(text)
            ctx.emit.message_completed(text)
            ctx.emit.run_completed()

    if __name__ == "__main__":
        serve(Shout())

``ctx`` carries the run context (``ctx.event``, ``ctx.input``, ``ctx.conversation``,
``ctx.context``, ``ctx.runtime``, ``ctx.config``, ``ctx.resources``, …), the result emitter
``ctx.emit`` (one method per result type), the Host API ``ctx.api`` and the cancel flag
(``ctx.cancelled``, ``ctx.wait_cancelled(timeout)``). Standard library only.

Layout:

- ``serve``: :func:`serve`, :class:`AgentRunner`; the reader thread, run threads, shutdown.
- ``context``: :class:`RunContext` and the typed ``AgentRunContext`` dataclasses.
- ``emit``: :class:`Emitter` (``ctx.emit``), sequencing and the terminal rule.
- ``results``: builders of the nine ``AgentRunResult`` types.
- ``api``: :class:`HostApi` (``ctx.api``), the call-id router, streamed answers.
- ``wire``: line framing and the locked protocol writer.
- ``errors``: :class:`HostApiError` and the protocol's error and failure codes.
- ``scaffold`` / ``__main__``: ``python -m switchboard_runner new NAME``.
"""

from . import results
from .api import AgentRunAPIProxy, ApiCallStream, HostApi, LlmStream
from .context import (
    ActorContext,
    AgentEventContext,
    AgentInput,
    AgentResources,
    AgentRunContext,
    AgentRunState,
    AgentRuntimeContext,
    AgentTrigger,
    ContextAccess,
    ContextAPICapabilities,
    ConversationContext,
    DeliveryContext,
    RunContext,
    SubjectContext,
    parse_context,
)
from .emit import Emitter
from .errors import (
    AgentAPIError,
    AgentAPIException,
    EmitError,
    ErrorCode,
    HostApiError,
    RunFailed,
    RunFailure,
    RunFinished,
)
from .serve import AgentRunner, RunOutput, Runner, serve

__version__ = "0.1.0"

__all__ = [
    "ActorContext",
    "AgentAPIError",
    "AgentAPIException",
    "AgentEventContext",
    "AgentInput",
    "AgentResources",
    "AgentRunAPIProxy",
    "AgentRunContext",
    "AgentRunState",
    "AgentRunner",
    "AgentRuntimeContext",
    "AgentTrigger",
    "ApiCallStream",
    "ContextAPICapabilities",
    "ContextAccess",
    "ConversationContext",
    "DeliveryContext",
    "EmitError",
    "Emitter",
    "ErrorCode",
    "HostApi",
    "HostApiError",
    "LlmStream",
    "RunContext",
    "RunFailed",
    "RunFailure",
    "RunFinished",
    "RunOutput",
    "Runner",
    "SubjectContext",
    "parse_context",
    "results",
    "serve",
]
