"""Request ids: unguessable, time-ordered, and cheap to validate before they reach a Redis key.

`req_` + base32 of 16 bytes: a 48-bit creation time in milliseconds, then 80 random bits (ULID-like).
The random part makes ids unguessable; the time part lets the gateway tell an id whose result has
expired (410 Gone) from one that never existed (404), without keeping anything per request.
"""

from __future__ import annotations

import base64
import re
import secrets
import time

_PREFIX = "req_"
_ID_RE = re.compile(r"^req_[a-z2-7]{26}$")


def new_request_id(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    raw = ms.to_bytes(6, "big") + secrets.token_bytes(10)
    return _PREFIX + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def is_request_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


def created_ms(request_id: str) -> int | None:
    """The creation time embedded in a well-formed id (None if it is not one)."""
    if not is_request_id(request_id):
        return None
    raw = base64.b32decode(request_id[len(_PREFIX):].upper() + "======")
    return int.from_bytes(raw[:6], "big")
