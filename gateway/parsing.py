"""Parsing and validation of what callers send: bodies, query parameters, headers, submit fields.

Pure functions over `ApiRequest`: everything a caller can get wrong becomes a 4xx `ApiError` or a
`ValidationError` with the field it concerns.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import msgpack

from gateway.api import MSGPACK_TYPES, ApiRequest, BadRequest, PayloadTooLarge, UnsupportedMediaType
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.ids import new_request_id
from shared.lanes import assign_lane, estimate_embed_tokens, estimate_generate_tokens
from shared.messages import Callback, InferenceRequest
from shared.params import EmbedParams, GenerateParams, finite_number, parse_embed_input, parse_generate_input
from shared.ssrf import AllowList, RefusedURL, check_url
from shared.states import Priority, Task

SUBMIT_FIELDS = {"input", "params", "timeout_s", "deadline", "priority", "callback"}
CALLBACK_EVENTS = ("started", "completed")
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*([0-9.]+)")


def parse_body(req: ApiRequest, max_bytes: int) -> Any:
    if len(req.body) > max_bytes:
        raise PayloadTooLarge(f"body is {len(req.body)} bytes; the limit is {max_bytes}")
    if not req.body:
        raise BadRequest("empty body: send a JSON object", code="invalid_body")
    ctype = (req.header("content-type") or "application/json").split(";")[0].strip().lower()
    if ctype in MSGPACK_TYPES:
        try:
            body = msgpack.unpackb(req.body, raw=False)
        except Exception as exc:
            raise BadRequest(f"invalid msgpack body: {exc}", code="invalid_body") from exc
        _check_shape(body)
        return body
    if ctype not in ("application/json", "text/plain", "application/x-www-form-urlencoded", ""):
        raise UnsupportedMediaType(f"content type {ctype!r} not supported; send application/json "
                                   "or application/msgpack")
    try:
        body = json.loads(req.body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"invalid JSON: {str(exc)[:200]}", code="invalid_json") from exc
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
            _check_shape(v, depth + 1)


def parse_wait(req: ApiRequest, cap: float) -> float:
    """`?wait=S` or `Prefer: wait=S`; 0 when absent. Capped at the gateway's maximum."""
    raw = req.query.get("wait")
    if raw is None:
        m = _PREFER_WAIT.search(req.header("prefer") or "")
        raw = m.group(1) if m else None
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise BadRequest(f"wait must be a number of seconds, got {raw!r}", code="invalid_wait") from exc
    if finite_number(value) is None or value < 0:
        raise BadRequest("wait must be a non-negative number of seconds", code="invalid_wait")
    return min(value, cap)


def parse_deadline(body: dict[str, Any], spec: ModelSpec, now: float) -> float:
    """Absolute deadline (epoch seconds) from `timeout_s` or `deadline`, else the model's default."""
    if "timeout_s" in body and "deadline" in body:
        raise ValidationError("timeout_s", "give either timeout_s or deadline, not both")
    if "timeout_s" in body:
        t = finite_number(body["timeout_s"])
        if t is None or t <= 0:
            raise ValidationError("timeout_s", "must be a positive number of seconds")
        if t > spec.max_timeout_s:
            raise ValidationError("timeout_s", f"at most {spec.max_timeout_s} seconds for this model")
        return now + float(t)
    if "deadline" in body:
        d = body["deadline"]
        if isinstance(d, str):
            try:
                parsed = datetime.fromisoformat(d.replace("Z", "+00:00"))
            except ValueError as exc:
                raise ValidationError("deadline", "must be epoch seconds or an ISO 8601 time") from exc
            if parsed.tzinfo is None:
                raise ValidationError("deadline", "an ISO 8601 deadline needs a time zone (e.g. Z)")
            value = parsed.timestamp()
        elif finite_number(d) is not None:
            value = float(d)
        else:
            raise ValidationError("deadline", "must be epoch seconds or an ISO 8601 time")
        if value <= now:
            raise ValidationError("deadline", "is in the past")
        if value - now > spec.max_timeout_s:
            raise ValidationError("deadline", f"at most {spec.max_timeout_s} seconds ahead for this model")
        return value
    return now + spec.default_timeout_s


def parse_callback(raw: Any, allow: AllowList) -> Callback:
    if not isinstance(raw, dict):
        raise ValidationError("callback", "must be an object with `url` and optional `events`")
    unknown = sorted(set(raw) - {"url", "events"})
    if unknown:
        raise ValidationError(f"callback.{unknown[0]}", "unknown field (allowed: url, events)")
    events = raw.get("events", ["completed"])
    if (not isinstance(events, list) or not events or any(e not in CALLBACK_EVENTS for e in events)
            or len(set(events)) != len(events)):
        raise ValidationError("callback.events", f"a list of distinct events from {list(CALLBACK_EVENTS)}")
    url = raw.get("url")
    if isinstance(url, str) and not url.isprintable():
        raise ValidationError("callback.url", "must not contain control characters")
    try:
        check_url(url, allow)
    except RefusedURL as exc:
        raise ValidationError("callback.url", str(exc)) from exc
    return Callback(url=raw["url"], events=tuple(events))


def build_request(body: Any, spec: ModelSpec, tenant: str, now: float,
                  allow: AllowList | None = None) -> InferenceRequest:
    if not isinstance(body, dict):
        raise ValidationError("", "the body must be a JSON object")
    unknown = sorted(set(body) - SUBMIT_FIELDS)
    if unknown:
        raise ValidationError(unknown[0], f"unknown field (allowed: {', '.join(sorted(SUBMIT_FIELDS))})")
    if "input" not in body:
        raise ValidationError("input", "required")
    allow = allow or AllowList()
    if spec.task is Task.GENERATE:
        params = GenerateParams.parse(body.get("params"), limit=spec.max_new_tokens,
                                      default_max_new_tokens=spec.default_max_new_tokens)
        inp = parse_generate_input(body["input"], max_prompt_chars=spec.max_input_tokens * 16,
                                   max_input_tokens=spec.max_input_tokens)
        _, tokens = estimate_generate_tokens(inp, params.max_new_tokens)
        params_dict = params.to_dict()
    else:
        eparams = EmbedParams.parse(body.get("params"))
        inp = parse_embed_input(body["input"], max_texts=spec.max_texts,
                                max_text_chars=spec.max_input_tokens * 16)
        tokens = estimate_embed_tokens(inp)
        params_dict = eparams.to_dict()
    callback = parse_callback(body.get("callback"), allow) if "callback" in body else None
    priority = body.get("priority", Priority.INTERACTIVE.value)
    if priority not in (p.value for p in Priority):
        raise ValidationError("priority", "must be interactive or batch")
    deadline = parse_deadline(body, spec, now)
    return InferenceRequest(
        id=new_request_id(int(now * 1000)), tenant=tenant, model=spec.name, task=spec.task, input=inp,
        params=params_dict,
        lane=assign_lane(tokens, spec.lanes).name, priority=Priority(priority), created_ms=int(now * 1000),
        deadline_ms=int(deadline * 1000), est_tokens=tokens, callback=callback,
    )


def parse_idempotency_key(req: ApiRequest) -> str | None:
    key = req.header("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise BadRequest("Idempotency-Key must be 1-255 printable characters", code="invalid_idempotency_key")
    return key


