"""The rule an Idempotency-Key obeys, with no dependencies: the gateway refuses a key that breaks it (400
`invalid_idempotency_key`), and the SDK checks it before sending, since a key no header can carry is the caller's
to fix, not a connection failure to retry."""

from __future__ import annotations

MAX_KEY_CHARS = 255
KEY_RULE = f"Idempotency-Key must be 1-{MAX_KEY_CHARS} printable characters"


def valid_idempotency_key(key: str) -> bool:
    return 1 <= len(key) <= MAX_KEY_CHARS and key.isprintable()
