"""The errors a caller can get, each with the status it means in the API (DESIGN section 3).

One hierarchy for both ways in: the HTTP gateway renders them (`gateway.api.error_response`), the SDK's
direct mode turns them into its typed errors through the same status, so both answer alike. The body
is always `{"error": {"code", "message", ...extra}}` (`shared.views.ErrorBody`).
"""

from __future__ import annotations

import math
from typing import Any


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, retry_after: float | None = None,
                 extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.retry_after = retry_after
        self.extra = extra or {}
        self._headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.extra}}

    @property
    def retryable(self) -> bool:
        """False when the answer says no retry of the same request can change it (`x-should-retry: false`)."""
        return self._headers.get("x-should-retry") != "false"

    def headers(self) -> dict[str, str]:
        """`Retry-After` in whole seconds (at least 1) when the caller should retry later."""
        if self.retry_after is None:
            return dict(self._headers)
        return {**self._headers, "Retry-After": str(max(1, math.ceil(self.retry_after)))}


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"


class RequestTimeout(ApiError):
    status = 408
    code = "request_timeout"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class Gone(ApiError):
    status = 410
    code = "gone"


class PayloadTooLarge(ApiError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    code = "unsupported_media_type"


class Unprocessable(ApiError):
    status = 422
    code = "invalid_request"


class TooManyRequests(ApiError):
    status = 429
    code = "over_capacity"


class ServiceUnavailable(ApiError):
    status = 503
    code = "unavailable"


def unavailable(exc: BaseException) -> ServiceUnavailable:
    """The 503 for Redis refusing a call: unreachable (or full, or a replica mid-failover), or, with durable writes
    on, a write its replicas did not confirm in time, which says so (it is not an outage: /readyz says why)."""
    from shared.redis_io import NotReplicated  # here: a caller of this module need not load redis-py

    if isinstance(exc, NotReplicated):
        return ServiceUnavailable("the write was not confirmed by as many Redis replicas as "
                                  f"BATCHGATE_REDIS_WAIT_REPLICAS asks for ({exc}); nothing was accepted, retry "
                                  "shortly", code="not_replicated", retry_after=1)
    return ServiceUnavailable("the queue is unreachable; retry shortly", retry_after=1)
