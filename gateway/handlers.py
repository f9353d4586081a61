"""Transport-agnostic handlers: `ApiRequest` in, `ApiResponse` out.

The same functions run behind the Starlette app, an AWS Lambda and a Google Cloud Function.
Everything a caller can get wrong is answered with a 4xx and a message; Redis being unreachable is
a 503 with Retry-After; nothing a caller sends produces a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import msgpack
import structlog

from gateway import metrics
from gateway.api import (
    MSGPACK_TYPES,
    ApiError,
    ApiRequest,
    ApiResponse,
    BadRequest,
    Conflict,
    Gone,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    Unprocessable,
    UnsupportedMediaType,
)
from gateway.service import GatewayService, IdempotencyClaim
from gateway.views import record_view
from shared.admission import Decision, Estimate
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.ids import created_ms, is_request_id, new_request_id
from shared.lanes import assign_lane, estimate_embed_tokens, estimate_generate_tokens
from shared.messages import InferenceRequest
from shared.params import EmbedParams, GenerateParams, parse_embed_input, parse_generate_input
from shared.redis_io import UNAVAILABLE
from shared.states import Priority, Status, Task

log = structlog.get_logger(__name__)

SUBMIT_FIELDS = {"input", "params", "timeout_s", "deadline", "priority"}
IDEMPOTENCY_TAKEOVER_S = 5.0  # a key claimed this long ago without a stored request is taken over
IDEMPOTENCY_RACE_POLLS = 20
IDEMPOTENCY_RACE_POLL_S = 0.025
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*([0-9.]+)")


# --- parsing helpers -----------------------------------------------------------------------------

def parse_body(req: ApiRequest, max_bytes: int) -> Any:
    if len(req.body) > max_bytes:
        raise PayloadTooLarge(f"body is {len(req.body)} bytes; the limit is {max_bytes}")
    if not req.body:
        raise BadRequest("empty body: send a JSON object", code="invalid_body")
    ctype = (req.header("content-type") or "application/json").split(";")[0].strip().lower()
    if ctype in MSGPACK_TYPES:
        try:
            return msgpack.unpackb(req.body, raw=False)
        except Exception as exc:
            raise BadRequest(f"invalid msgpack body: {exc}", code="invalid_body") from exc
    if ctype not in ("application/json", "text/plain", "application/x-www-form-urlencoded", ""):
        raise UnsupportedMediaType(f"content type {ctype!r} not supported; send application/json "
                                   "or application/msgpack")
    try:
        return json.loads(req.body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"invalid JSON: {exc}", code="invalid_json") from exc


def parse_wait(req: ApiRequest, cap: float) -> float:
    """`?wait=S` or `Prefer: wait=S`; 0 when absent. Capped at the gateway's maximum."""
    raw = req.query.get("wait")
    if raw is None:
        m = _PREFER_WAIT.search(req.header("prefer") or "")
        raw = m.group(1) if m else None
    if raw is None or raw == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise BadRequest(f"wait must be a number of seconds, got {raw!r}", code="invalid_wait") from exc
    if not math.isfinite(value) or value < 0:
        raise BadRequest("wait must be a non-negative number of seconds", code="invalid_wait")
    return min(value, cap)


def parse_deadline(body: dict[str, Any], spec: ModelSpec, now: float) -> float:
    """Absolute deadline (epoch seconds) from `timeout_s` or `deadline`, else the model's default."""
    if "timeout_s" in body and "deadline" in body:
        raise ValidationError("timeout_s", "give either timeout_s or deadline, not both")
    if "timeout_s" in body:
        t = body["timeout_s"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
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
        elif isinstance(d, int | float) and not isinstance(d, bool) and math.isfinite(d):
            value = float(d)
        else:
            raise ValidationError("deadline", "must be epoch seconds or an ISO 8601 time")
        if value <= now:
            raise ValidationError("deadline", "is in the past")
        if value - now > spec.max_timeout_s:
            raise ValidationError("deadline", f"at most {spec.max_timeout_s} seconds ahead for this model")
        return value
    return now + spec.default_timeout_s


def build_request(body: Any, spec: ModelSpec, tenant: str, now: float) -> InferenceRequest:
    if not isinstance(body, dict):
        raise ValidationError("", "the body must be a JSON object")
    unknown = sorted(set(body) - SUBMIT_FIELDS)
    if unknown:
        raise ValidationError(unknown[0], f"unknown field (allowed: {', '.join(sorted(SUBMIT_FIELDS))})")
    if "input" not in body:
        raise ValidationError("input", "required")
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
    priority = body.get("priority", Priority.INTERACTIVE.value)
    if priority not in (p.value for p in Priority):
        raise ValidationError("priority", "must be interactive or batch")
    deadline = parse_deadline(body, spec, now)
    return InferenceRequest(
        id=new_request_id(int(now * 1000)), tenant=tenant, model=spec.name, task=spec.task, input=inp,
        params=params_dict,
        lane=assign_lane(tokens, spec.lanes).name, priority=Priority(priority), created_ms=int(now * 1000),
        deadline_ms=int(deadline * 1000), est_tokens=tokens,
    )


def parse_idempotency_key(req: ApiRequest) -> str | None:
    key = req.header("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise BadRequest("Idempotency-Key must be 1-255 printable characters", code="invalid_idempotency_key")
    return key


def _model(svc: GatewayService, name: str) -> ModelSpec:
    spec = svc.settings.model(name)
    if spec is None:
        known = ", ".join(m.name for m in svc.settings.models)
        raise NotFound(f"unknown model {name!r} (known: {known})", code="model_not_found")
    return spec


def _links(request_id: str) -> dict[str, str]:
    return {"self": f"/v1/requests/{request_id}"}


# --- handlers ------------------------------------------------------------------------------------

async def submit(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    spec = _model(svc, model)
    wait = parse_wait(req, svc.settings.max_wait_s)
    body = parse_body(req, svc.settings.max_body_bytes)
    idem_key = parse_idempotency_key(req)
    try:
        inference = build_request(body, spec, req.tenant, svc.clock())
    except ValidationError as exc:
        raise Unprocessable(exc.message if not exc.field else f"{exc.field}: {exc.message}",
                            extra={"field": exc.field}) from exc
    body_hash = ""
    if idem_key is not None:
        inference = dataclasses.replace(inference, idempotency_key=idem_key)
        body_hash = hashlib.sha256(
            (spec.name + "\0" + json.dumps(body, sort_keys=True, separators=(",", ":"))).encode()).hexdigest()
        existing = await svc.idempotency_get(req.tenant, idem_key)
        if existing is not None:
            return await _replay(svc, req, existing, body_hash, inference, wait)
    decision, _ = await svc.admit(inference, spec)
    if not decision.accept:
        metrics.REJECTED.labels(spec.name, inference.lane, decision.code).inc()
        raise TooManyRequests(decision.reason, code=decision.code, retry_after=decision.retry_after_s,
                              extra={"lane": inference.lane})
    if idem_key is not None:
        claim = IdempotencyClaim(inference.id, body_hash, svc.now_ms())
        existing = await svc.idempotency_claim(req.tenant, idem_key, claim)
        if existing is not None:  # a concurrent submit with the same key won the race
            return await _replay(svc, req, existing, body_hash, inference, wait)
    return await _store_and_answer(svc, inference, decision, wait)


async def _store_and_answer(svc: GatewayService, inference: InferenceRequest, decision: Decision,
                            wait: float, headers: dict[str, str] | None = None) -> ApiResponse:
    submitted = await svc.submit(inference, decision)
    metrics.SUBMITTED.labels(inference.model, inference.lane).inc()
    structlog.contextvars.bind_contextvars(request_id=inference.id, model=inference.model, lane=inference.lane)
    log.info("request accepted", priority=inference.priority.value, est_tokens=inference.est_tokens)
    headers = {"Location": _links(inference.id)["self"], **(headers or {})}
    if wait > 0:
        rec = await svc.wait(inference.id, wait)
        if rec is not None and rec.terminal:
            return ApiResponse(200, record_view(rec), headers)
    est = submitted.decision.estimate
    body_out = {
        "id": inference.id,
        "status": Status.QUEUED.value,
        "model": inference.model,
        "lane": inference.lane,
        "eta_ms": round(est.finish_s * 1000) if est.basis == "stats" else None,
        "queue_position": submitted.queue_position,
        "deadline": inference.deadline_ms / 1000,
        "links": _links(inference.id),
    }
    if est.basis != "stats":
        body_out["admission"] = ("no worker has reported load recently: accepted without an estimate "
                                 "(up to the lane's backlog cap)")
    return ApiResponse(202, body_out, headers)


async def _replay(svc: GatewayService, req: ApiRequest, existing: IdempotencyClaim, body_hash: str,
                  inference: InferenceRequest, wait: float) -> ApiResponse:
    """A submit whose Idempotency-Key was seen before: the original request, never a second one."""
    if existing.body_hash != body_hash:
        raise Conflict("this Idempotency-Key was used with a different request body", code="idempotency_conflict")
    replayed = {"Idempotent-Replayed": "true", "Location": _links(existing.request_id)["self"]}
    rec = await svc.get(existing.request_id)
    for _ in range(IDEMPOTENCY_RACE_POLLS):  # the first submit is a few milliseconds ahead of us
        if rec is not None or svc.now_ms() - existing.at_ms > IDEMPOTENCY_TAKEOVER_S * 1000:
            break
        await asyncio.sleep(IDEMPOTENCY_RACE_POLL_S)
        rec = await svc.get(existing.request_id)
    if rec is None:
        if svc.now_ms() - existing.at_ms <= IDEMPOTENCY_TAKEOVER_S * 1000:
            raise Conflict("a request with this Idempotency-Key is being accepted; retry shortly",
                           code="idempotency_in_progress", retry_after=1)
        # the first submit claimed the key and never stored its request (its gateway died): store it now,
        # under the same id, so the key still maps to exactly one request
        takeover = dataclasses.replace(inference, id=existing.request_id)
        await svc.idempotency_claim(req.tenant, inference.idempotency_key or "",
                                    IdempotencyClaim(takeover.id, body_hash, svc.now_ms()), replace=True)
        return await _store_and_answer(svc, takeover, Decision(True, Estimate(0.0, 0.0, "none")), wait, replayed)
    if wait > 0 and not rec.terminal:
        rec = await svc.wait(rec.id, wait) or rec
    return ApiResponse(200 if rec.terminal else 202, record_view(rec), replayed)


async def get_request(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    wait = parse_wait(req, svc.settings.max_wait_s)
    rec = await _visible(svc, req, request_id)
    if wait > 0 and not rec.terminal:
        rec = await svc.wait(request_id, wait) or rec
    return ApiResponse(200, record_view(rec))


async def cancel_request(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    rec = await _visible(svc, req, request_id)
    if rec.terminal:
        if rec.state is Status.CANCELLED:
            return ApiResponse(200, record_view(rec))
        raise Conflict(f"request already {rec.state.value}; nothing to cancel", code="already_finished")
    await svc.cancel(rec)
    rec = await svc.get(request_id) or rec
    if rec.state is not Status.CANCELLED:  # a worker finished it first
        raise Conflict(f"request already {rec.state.value}; nothing to cancel", code="already_finished")
    metrics.CANCELLED.labels(rec.meta.model if rec.meta else "unknown").inc()
    return ApiResponse(200, record_view(rec))


async def _visible(svc: GatewayService, req: ApiRequest, request_id: str) -> Any:
    if not is_request_id(request_id):
        raise NotFound(f"no request {request_id!r}", code="request_not_found")
    rec = await svc.get(request_id)
    if rec is None or (rec.meta is not None and rec.meta.tenant != req.tenant):
        born = created_ms(request_id) or 0
        ttl = svc.settings.result_ttl_s
        if rec is None and svc.now_ms() - born > ttl * 1000:
            raise Gone(f"request {request_id!r} is gone: results are kept for {ttl} s", code="result_expired")
        raise NotFound(f"no request {request_id!r}", code="request_not_found")
    return rec


async def list_models(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    out = []
    for spec in svc.settings.models:
        backlog = await svc.backlog(spec.name, spec.lane_names)
        _, stats = await svc.load(spec.name, spec.lane_names[0])
        public = spec.to_public()
        public["workers"] = len(stats)
        for lane in public["lanes"]:
            name = lane["name"]
            loads = [ln for s in stats for ln in s.lanes if ln.lane == name]
            lane["backlog"] = backlog[name]
            lane["running"] = sum(ln.running for ln in loads)
            lane["service_rate_rps"] = round(sum(ln.completed_rps for ln in loads), 3)
            lane["est_wait_ms"] = round(min(ln.est_wait_ms for ln in loads)) if loads else None
        out.append(public)
    return ApiResponse(200, {"models": out})


async def healthz(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return ApiResponse(200, {"status": "ok"})


async def readyz(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    try:
        await svc.ping()
    except UNAVAILABLE as exc:
        raise ServiceUnavailable(f"redis unreachable: {type(exc).__name__}", retry_after=1) from exc
    return ApiResponse(200, {"status": "ready"})


Handler = Callable[..., Awaitable[ApiResponse]]


async def dispatch(handler: Handler, svc: GatewayService, req: ApiRequest, *args: str) -> ApiResponse:
    """Run a handler; translate errors in exactly one place."""
    try:
        return await handler(svc, req, *args)
    except ApiError as exc:
        metrics.ERRORS.labels(exc.code).inc()
        return exc.to_response()
    except UNAVAILABLE as exc:
        metrics.ERRORS.labels("unavailable").inc()
        log.warning("redis unavailable", error=repr(exc))
        return ServiceUnavailable("the queue is unreachable; retry shortly", retry_after=1).to_response()
    finally:
        structlog.contextvars.clear_contextvars()
