"""Typed SDK errors, one per thing a caller would handle differently."""

from __future__ import annotations

from typing import Any


class BatchgateError(Exception):
    def __init__(self, message: str, *, status: int | None = None, code: str = "", body: Any = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.body = body
        self.retry_after = retry_after


class InvalidRequest(BatchgateError):
    """400/413/415/422: fix the request; retrying it as is will not help."""


class AuthError(BatchgateError):
    """401: missing, invalid or revoked API key."""


class NotFound(BatchgateError):
    """404/410: unknown id or model, another tenant's request, or a result that expired."""


class Conflict(BatchgateError):
    """409: e.g. an Idempotency-Key reused with another body, or cancelling a finished request."""


class OverCapacity(BatchgateError):
    """429: the lane's backlog or the tenant's rate or quota is full; retry after `retry_after`."""


class DeadlineInfeasible(OverCapacity):
    """The deadline cannot be met (refused at submit, or too little Lambda time left to send it)."""


class Unavailable(BatchgateError):
    """503 or no answer: the queue is unreachable; retry after `retry_after`."""


class RequestFailed(BatchgateError):
    """`result()` of a request that ended failed, expired or cancelled (the result is `.result`)."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message, code=getattr(result, "status", ""))
        self.result = result


def error_for(status: int, body: Any, retry_after: float | None) -> BatchgateError:
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code, message = err.get("code", ""), err.get("message", f"HTTP {status}")
    cls: type[BatchgateError] = BatchgateError
    if status in (400, 413, 415, 422):
        cls = InvalidRequest
    elif status == 401:
        cls = AuthError
    elif status in (404, 410):
        cls = NotFound
    elif status == 409:
        cls = Conflict
    elif status == 429:
        cls = DeadlineInfeasible if code == "deadline_infeasible" else OverCapacity
    elif status in (502, 503, 504):
        cls = Unavailable
    return cls(message, status=status, code=code, body=body, retry_after=retry_after)
