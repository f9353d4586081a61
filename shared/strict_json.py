"""JSON as RFC 8259 defines it, for what callers send: Python's `json` reads `NaN`, `Infinity` and `-Infinity`,
which are not JSON (OpenAI, msgspec and browsers' `JSON.parse` refuse them). Read as numbers they would reach
range checks that misname the fault ("must be at least 0.0" for `NaN`)."""

from __future__ import annotations

import json
from typing import Any


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def loads(raw: bytes | str) -> Any:
    """`json.loads`, refusing NaN and Infinity with a ValueError that names them."""
    return json.loads(raw, parse_constant=_constant)
