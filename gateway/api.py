"""The small request/response types the handlers speak.

Handlers never see Starlette, Lambda events or Flask requests: each transport adapts to these.
The errors are `shared.api_errors` (the SDK's direct mode raises the same ones); they become
`{"error": {"code", "message"}}` with their status in exactly one place (`error_response`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared.api_errors import (
    ApiError,
    BadRequest,
    Conflict,
    Gone,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
    Unprocessable,
    UnsupportedMediaType,
)

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


def error_response(exc: ApiError) -> ApiResponse:
    """The one place an error becomes a response: its status, its body, `Retry-After` if it has one."""
    return ApiResponse(exc.status, exc.body(), exc.headers())


__all__ = [
    "MSGPACK_TYPES",
    "ApiError",
    "ApiRequest",
    "ApiResponse",
    "BadRequest",
    "Conflict",
    "Gone",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "ServiceUnavailable",
    "TooManyRequests",
    "Unauthorized",
    "Unprocessable",
    "UnsupportedMediaType",
    "error_response",
]
