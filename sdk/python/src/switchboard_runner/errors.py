"""Errors of the SDK and the error vocabulary of the protocol.

A Host API call that the host refuses raises :class:`HostApiError` (alias
:data:`AgentAPIException`, the seed SDK's name) carrying the PROTOCOL_V1 §9 error
``{code, message, retryable, details}``. A runner ends a run as failed by raising
:class:`RunFailed` (or by emitting ``run.failed`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Mapping

__all__ = [
    "AgentAPIError",
    "AgentAPIException",
    "ErrorCode",
    "EmitError",
    "HostApiError",
    "RunFailed",
    "RunFailure",
    "RunFinished",
]


class ErrorCode:
    """The ``code`` values of Host API errors (the host's closed set).

    The first seven are PROTOCOL_V1 §9's; the others are the distributed host's additions.
    A newer host may send a code not listed here: compare with strings, not an enum.
    """

    INVALID_ARGUMENT: Final = "invalid_argument"
    UNAUTHORIZED: Final = "unauthorized"
    NOT_FOUND: Final = "not_found"
    PAYLOAD_TOO_LARGE: Final = "payload_too_large"
    RATE_LIMITED: Final = "rate_limited"
    DEADLINE_EXCEEDED: Final = "deadline_exceeded"
    RUNTIME_ERROR: Final = "runtime_error"
    CONFLICT: Final = "conflict"
    BUDGET_EXCEEDED: Final = "budget_exceeded"
    UNAVAILABLE: Final = "unavailable"
    INTERNAL: Final = "internal"
    CANCELLED: Final = "cancelled"
    TOOL_OUTCOME_UNKNOWN: Final = "tool_outcome_unknown"
    PERMISSION_DENIED: Final = "permission_denied"


class RunFailure:
    """``run.failed`` codes the host itself emits (runners may use their own dotted codes)."""

    RUNNER_ERROR: Final = "runner.error"
    RUNNER_CRASHED: Final = "runner.crashed"
    RUNNER_PROTOCOL_ERROR: Final = "runner.protocol_error"
    RUNNER_EMPTY_OUTPUT: Final = "runner.empty_output"
    CANCELLED: Final = "cancelled"
    TIMEOUT: Final = "timeout"
    INTERRUPTED: Final = "interrupted"


@dataclass(frozen=True)
class AgentAPIError:
    """The structured error of a Host API answer (PROTOCOL_V1 §9)."""

    code: str
    message: str
    retryable: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "details": dict(self.details),
        }


class HostApiError(Exception):
    """A Host API call failed: the host refused it, or the SDK gave up waiting.

    Besides the host's codes the SDK raises ``cancelled`` (the run was cancelled while
    the call was in flight), ``deadline_exceeded`` (the run's deadline passed first) and
    ``unavailable`` (the host connection is gone).
    """

    def __init__(
        self,
        code: str,
        message: str,
        retryable: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code: str = code
        self.message: str = message
        self.retryable: bool = retryable
        self.details: dict[str, Any] = dict(details or {})

    @property
    def error(self) -> AgentAPIError:
        """The error as a value (the seed SDK's ``AgentAPIException.error``)."""
        return AgentAPIError(self.code, self.message, self.retryable, dict(self.details))

    @classmethod
    def from_wire(cls, error: Any) -> HostApiError:
        """Builds the exception from the ``error`` object of an ``api_result``.

        A malformed error (not an object, no code) still becomes an exception, with code
        ``runtime_error``, so a runner never sees a bare ``KeyError``.
        """
        if not isinstance(error, Mapping):
            return cls(ErrorCode.RUNTIME_ERROR, f"host answered with a malformed error: {error!r}")
        code = error.get("code")
        message = error.get("message")
        details = error.get("details")
        return cls(
            code if isinstance(code, str) and code else ErrorCode.RUNTIME_ERROR,
            message if isinstance(message, str) else "host api call failed",
            bool(error.get("retryable", False)),
            details if isinstance(details, Mapping) else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return self.error.to_dict()

    def __repr__(self) -> str:
        return f"HostApiError(code={self.code!r}, message={self.message!r}, retryable={self.retryable!r})"


#: The seed SDK's name of :class:`HostApiError`.
AgentAPIException = HostApiError


class RunFailed(Exception):
    """Raise from ``run`` to end the run with ``run.failed {code, error, retryable}``."""

    def __init__(self, message: str, code: str = RunFailure.RUNNER_ERROR, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code: str = code
        self.message: str = message
        self.retryable: bool = retryable


class EmitError(Exception):
    """A result could not be written (not JSON-serialisable, too long, host gone)."""


class RunFinished(EmitError):
    """The run already has its terminal result; the host would drop anything more."""
