"""Request ids: random, unguessable, and cheap to validate before they reach a Redis key."""

from __future__ import annotations

import base64
import re
import secrets

_PREFIX = "req_"
_ID_RE = re.compile(r"^req_[a-z2-7]{26}$")


def new_request_id() -> str:
    """128 random bits, base32 (lowercase, no padding): `req_` + 26 characters."""
    raw = secrets.token_bytes(16)
    return _PREFIX + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def is_request_id(value: str) -> bool:
    return bool(_ID_RE.match(value))
