"""Parsing of the HTTP side of what callers send: bodies (JSON or msgpack), query parameters, headers.

Pure functions over `ApiRequest`: everything a caller can get wrong becomes a 4xx `ApiError`. What the
body means (the submit fields) is checked by `shared.submit`, against the schema types.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from gateway.api import MSGPACK_TYPES, ApiRequest, BadRequest, PayloadTooLarge, UnsupportedMediaType
from shared import strict_json
from shared.operations import check_idempotency_key, wait_seconds

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\"[^\"]*\"|[^,;\s]*)", re.I)
JSON_TYPES = ("application/json", "")  # no Content-Type at all: read as JSON
_MSGPACK_HINTS = {
    "FormatError": "it starts with a byte that begins no msgpack value",
    "ExtraData": "it holds more than one msgpack value (or is not msgpack at all)",
    "StackError": "it is nested too deeply",
}


def parse_body(req: ApiRequest, max_bytes: int) -> Any:
    if len(req.body) > max_bytes:
        raise PayloadTooLarge(f"body is {len(req.body)} bytes; the limit is {max_bytes}")
    if not req.body:
        raise BadRequest("empty body: send a JSON object", code="invalid_body")
    encoding = (req.header("content-encoding") or "identity").strip().lower()
    if encoding != "identity":  # read as it is, a compressed body would be answered as malformed JSON
        raise UnsupportedMediaType(f"content encoding {encoding!r} not supported: send the body uncompressed",
                                   code="unsupported_content_encoding")
    declared = req.header("content-type")
    if not declared:  # a browser sends an untyped body (a Blob, an ArrayBuffer) cross-site without a preflight
        raise UnsupportedMediaType("the body has no content type; send it as application/json or "
                                   "application/msgpack (a Content-Type header)")
    ctype = declared.split(";")[0].strip().lower()
    if ctype in MSGPACK_TYPES:
        return _msgpack_body(req.body)
    # only JSON's own type: text/plain and form bodies are what a browser may send cross-site without a
    # preflight, so reading them as JSON would let any web page submit (where auth is off)
    if ctype not in JSON_TYPES and not (ctype.startswith("application/") and ctype.endswith("+json")):
        hint = " (curl -d sends this by default: add -H 'content-type: application/json', or use --json)" \
            if ctype == "application/x-www-form-urlencoded" else ""
        raise UnsupportedMediaType(f"content type {ctype!r} not supported; send application/json "
                                   f"or application/msgpack{hint}")
    try:
        body = strict_json.loads(req.body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"invalid JSON: {str(exc)[:200]}", code="invalid_json") from exc
    _check_shape(body)
    return body


def _msgpack_body(raw: bytes) -> Any:
    """One msgpack value (an object), with an error that says what is wrong with the bytes."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except UnicodeDecodeError as exc:
        raise BadRequest("invalid msgpack body: a str value is not valid UTF-8 "
                         "(send text as UTF-8)", code="invalid_body") from exc
    except ValueError as exc:  # msgpack's own errors derive from ValueError
        name = type(exc).__name__
        hint = _MSGPACK_HINTS.get(name) or ("it ends in the middle of a value" if "incomplete" in str(exc)
                                            else str(exc) or name)
        raise BadRequest(f"invalid msgpack body ({len(raw)} bytes, first byte 0x{raw[0]:02x}): {hint}; send one "
                         "msgpack map with Content-Type: application/msgpack", code="invalid_body") from exc
    except Exception as exc:
        raise BadRequest(f"invalid msgpack body: {type(exc).__name__}", code="invalid_body") from exc
    _check_shape(body)
    return body


MAX_DEPTH = 32


def _check_shape(value: Any, depth: int = 0) -> None:
    """Plain JSON-like data: string keys only, nested at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"body nested deeper than {MAX_DEPTH} levels", code="invalid_body")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadRequest("object keys must be strings", code="invalid_body")
            _check_shape(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, dict | list):  # a scalar item has no shape to check (a token id list: no call each)
                _check_shape(v, depth + 1)


def parse_wait(req: ApiRequest, cap: float) -> float:
    """`?wait=S` or `Prefer: wait=S`; 0 when absent. Capped at the gateway's maximum."""
    raw = req.query.get("wait")
    if raw is None:
        m = _PREFER_WAIT.search(req.header("prefer") or "")
        raw = m.group(1).strip('"') if m else None
    if raw is None:
        return 0.0
    try:
        if not raw.isascii() or "_" in raw:  # float() takes other scripts' digits and "1_0": the API's number does not
            raise ValueError(raw)
        value = float(raw)
    except ValueError as exc:
        raise BadRequest(f"wait must be a number of seconds, got {raw!r}", code="invalid_wait") from exc
    return wait_seconds(value, cap)


def parse_idempotency_key(req: ApiRequest) -> str | None:
    key = req.header("idempotency-key")
    if key is None:
        return None
    return check_idempotency_key(key)


