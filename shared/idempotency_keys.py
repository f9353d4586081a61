"""The rule an Idempotency-Key obeys, with no dependencies: the gateway refuses a key that breaks it (400
`invalid_idempotency_key`), and the SDK checks it before sending, since a key no header can carry is the caller's
to fix, not a connection failure to retry."""

from __future__ import annotations

MAX_KEY_CHARS = 255
KEY_RULE = (f"Idempotency-Key must be 1-{MAX_KEY_CHARS} printable ASCII characters, no comma (a header sent twice "
            "reaches a Lambda or a Cloud Function as one, its values joined by commas)")
# the same rule as a JSON Schema pattern (the OpenAPI document's): printable ASCII, 0x20-0x7E, less the comma
KEY_PATTERN = "^[ -+\\--~]+$"


def valid_idempotency_key(key: str) -> bool:
    """1 to MAX_KEY_CHARS printable ASCII characters: what an HTTP header carries as it is (a header's other bytes
    arrive as whatever the server decodes them to), in a header or a body alike; and no comma: API Gateway, Mangum
    and WSGI servers join a header sent twice into one value with commas, so two keys would be taken as a third (a
    retry with either one made a second request), where the HTTP gateway answers `repeated_header`."""
    return 1 <= len(key) <= MAX_KEY_CHARS and key.isascii() and key.isprintable() and "," not in key


def derived_key(key: str, index: int) -> str:
    """The key of the `index`-th request a keyed call creates (an OpenAI choice, a batch item without its own key):
    the call's key and the index joined by a control character, which no valid key holds, so a derived key never
    equals one a caller sends (`<key>#<index>` did: a caller's own `abc#1` found the second choice of `abc`)."""
    return f"{key}\x1f{index}"
