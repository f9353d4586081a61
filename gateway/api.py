"""The small request/response types the handlers speak, and the gateway's one error hierarchy.

Handlers never see Starlette, Lambda events or Flask requests: each transport adapts to these.
Errors become `{"error": {"code", "message"}}` with their status in exactly one place (`to_response`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


@dataclass(frozen=True, slots=True)
class ApiRequest:
    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    tenant: str = "default"

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


@dataclass(slots=True)
class ApiResponse:
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        if self.body is None:
            return b"", "application/json"
        if accept and any(t in accept for t in MSGPACK_TYPES):
            return msgpack.packb(self.body, use_bin_type=True), "application/msgpack"
        return json.dumps(self.body, separators=(",", ":"), allow_nan=False).encode(), "application/json"


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, retry_after: float | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.retry_after = retry_after
        self.extra = extra or {}

    def to_response(self) -> ApiResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        body: dict[str, Any] = {"error": {"code": self.code, "message": self.message, **self.extra}}
        return ApiResponse(self.status, body, headers)


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
