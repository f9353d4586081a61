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
from typing import Any

import structlog

from gateway import metrics
from gateway.api import (
    ApiError,
    ApiRequest,
    ApiResponse,
    Conflict,
    Gone,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
    Unprocessable,
)
from gateway.parsing import parse_body, parse_idempotency_key, parse_wait
from gateway.service import GatewayService, IdempotencyClaim
from shared.admission import Decision
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.ids import created_ms, is_request_id
from shared.messages import InferenceRequest
from shared.redis_io import UNAVAILABLE
from shared.states import Status
from shared.submit import build_request
from shared.views import callback_view, record_view

log = structlog.get_logger(__name__)

IDEMPOTENCY_TAKEOVER_S = 5.0  # a key claimed this long ago without a stored request is taken over
IDEMPOTENCY_RACE_POLLS = 20
IDEMPOTENCY_RACE_POLL_S = 0.025


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
        inference = build_request(body, spec, req.tenant, svc.clock(), svc.callback_allow)
    except ValidationError as exc:
        raise Unprocessable(exc.message if not exc.field else f"{exc.field}: {exc.message}",
                            extra={"field": exc.field}) from exc
    if inference.callback and await svc.callbacks.is_disabled(req.tenant, inference.callback.url):
        raise Unprocessable("callback.url: this URL answered 410 Gone and is disabled for this tenant",
                            extra={"field": "callback.url"})
    body_hash = ""
    if idem_key is not None:
        inference = dataclasses.replace(inference, idempotency_key=idem_key)
        body_hash = _body_hash(spec.name, body)
        existing = await svc.idempotency_get(req.tenant, idem_key)
        if existing is not None:
            return await _replay(svc, req, existing, body_hash, inference, wait)
    decision = await _admit(svc, inference, spec)
    if idem_key is not None:
        claim = IdempotencyClaim(inference.id, body_hash, svc.now_ms())
        existing = await svc.idempotency_claim(req.tenant, idem_key, claim)
        if existing is not None:  # a concurrent submit with the same key won the race
            await svc.auth.release(req.tenant, inference.id)
            return await _replay(svc, req, existing, body_hash, inference, wait)
    return await _store_and_answer(svc, inference, decision, wait)


async def _admit(svc: GatewayService, inference: InferenceRequest, spec: ModelSpec) -> Decision:
    """Tenant limits (rate, quota slot) then the deadline/backlog estimate; a refusal frees the slot."""
    expires = inference.deadline_ms + int(svc.settings.expiry_grace_s * 1000)
    await svc.auth.admit(inference.tenant, inference.id, expires)
    decision, _ = await svc.admit(inference, spec)
    if not decision.accept:
        await svc.auth.release(inference.tenant, inference.id)
        metrics.REJECTED.labels(spec.name, inference.lane, decision.code).inc()
        raise TooManyRequests(decision.reason, code=decision.code, retry_after=decision.retry_after_s,
                              extra={"lane": inference.lane})
    return decision


def _body_hash(model: str, body: Any) -> str:
    """What makes two submits "the same request": everything but their deadline, which a retry from a
    Lambda recomputes (and so would turn every retry into a conflict)."""
    same = {k: v for k, v in body.items() if k not in ("timeout_s", "deadline")} if isinstance(body, dict) else body
    return hashlib.sha256((model + "\0" + json.dumps(same, sort_keys=True, separators=(",", ":"))).encode()).hexdigest()


async def submit_batch(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    """Many inputs in one call (e.g. an SQS batch): one id per accepted item, an error per refused one.

    Body: {"requests": [<submit body>, ...]}; an item may carry `idempotency_key` (an SQS message id,
    say) so a redelivered batch does not create its accepted items twice."""
    spec = _model(svc, model)
    body = parse_body(req, svc.settings.max_body_bytes)
    items = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise Unprocessable("requests: a non-empty list of submit bodies (objects) is required",
                            extra={"field": "requests"})
    if set(body) - {"requests"}:
        raise Unprocessable(f"{sorted(set(body) - {'requests'})[0]}: unknown field (allowed: requests)",
                            extra={"field": sorted(set(body) - {"requests"})[0]})
    if len(items) > svc.settings.max_batch_items:
        raise Unprocessable(f"requests: at most {svc.settings.max_batch_items} items per batch",
                            extra={"field": "requests"})
    results: list[dict[str, Any]] = []
    to_store: list[tuple[int, InferenceRequest, Decision]] = []
    for i, item in enumerate(items):
        try:
            results.append(await _batch_item(svc, req, spec, i, item, to_store))
        except ApiError as exc:
            err: dict[str, Any] = {"code": exc.code, "message": exc.message, **exc.extra}
            if exc.retry_after is not None:
                err["retry_after"] = exc.retry_after
            results.append({"index": i, "status": exc.status, "error": err})
    if to_store:
        stored = await svc.submit_many([(inf, dec) for _, inf, dec in to_store])
        for (i, inf, _), sub in zip(to_store, stored, strict=True):
            metrics.SUBMITTED.labels(inf.model, inf.lane).inc()
            est = sub.decision.estimate
            results[i] = {"index": i, "status": 202, "id": inf.id, "lane": inf.lane,
                          "queue_position": sub.queue_position,
                          "eta_ms": round(est.finish_s * 1000) if est.basis == "stats" else None,
                          "links": _links(inf.id)}
    accepted = sum(1 for r in results if r["status"] in (200, 202))
    return ApiResponse(200, {"results": results, "accepted": accepted, "refused": len(results) - accepted})


async def _batch_item(svc: GatewayService, req: ApiRequest, spec: ModelSpec, i: int, item: Any,
                      to_store: list[tuple[int, InferenceRequest, Decision]]) -> dict[str, Any]:
    key = item.get("idempotency_key")
    body = {k: v for k, v in item.items() if k != "idempotency_key"}
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 255):
        raise Unprocessable("idempotency_key must be a string of 1-255 characters",
                            extra={"field": f"requests[{i}].idempotency_key"})
    try:
        inference = build_request(body, spec, req.tenant, svc.clock(), svc.callback_allow)
    except ValidationError as exc:
        raise Unprocessable(f"{exc.field}: {exc.message}" if exc.field else exc.message,
                            extra={"field": f"requests[{i}].{exc.field}" if exc.field else f"requests[{i}]"}) from exc
    body_hash = _body_hash(spec.name, body)
    if key is not None:
        inference = dataclasses.replace(inference, idempotency_key=key)
        existing = await svc.idempotency_get(req.tenant, key)
        if existing is not None:
            return await _batch_replay(svc, req, i, existing, body_hash, inference)
    decision = await _admit(svc, inference, spec)
    if key is not None:
        existing = await svc.idempotency_claim(req.tenant, key, IdempotencyClaim(inference.id, body_hash,
                                                                                   svc.now_ms()))
        if existing is not None:
            await svc.auth.release(req.tenant, inference.id)
            return await _batch_replay(svc, req, i, existing, body_hash, inference)
    to_store.append((i, inference, decision))
    return {"index": i, "status": 0}  # filled in once stored


async def _batch_replay(svc: GatewayService, req: ApiRequest, i: int, existing: IdempotencyClaim, body_hash: str,
                        inference: InferenceRequest) -> dict[str, Any]:
    """A batch item whose key was seen: the original request, never a second one (as `_replay`)."""
    resp = await _replay(svc, req, existing, body_hash, inference, wait=0.0)
    return {"index": i, "status": resp.status, "id": existing.request_id, "replayed": True,
            "links": _links(existing.request_id)}


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
        # under the same id, so the key still maps to exactly one request. Compare-and-set: of several
        # takeovers at once, one wins; the others answer as replays.
        takeover = dataclasses.replace(inference, id=existing.request_id)
        fresh = IdempotencyClaim(takeover.id, body_hash, svc.now_ms())
        if not await svc.idempotency_takeover(req.tenant, inference.idempotency_key or "", existing, fresh):
            raise Conflict("a request with this Idempotency-Key is being accepted; retry shortly",
                           code="idempotency_in_progress", retry_after=1)
        spec = _model(svc, takeover.model)
        decision = await _admit(svc, takeover, spec)
        return await _store_and_answer(svc, takeover, decision, wait, replayed)
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


async def replay_callback(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    """Send a dead-lettered (or failed) webhook again, from attempt zero."""
    rec = await _visible(svc, req, request_id)
    if rec.meta is None or rec.meta.callback is None:
        raise NotFound("this request has no callback", code="no_callback")
    if rec.callback is None:
        raise Conflict("the callback has not been attempted yet", code="callback_pending")
    fresh = await svc.callbacks.replay(rec.callback.delivery_id, svc.now_ms())
    if fresh is None:
        raise Conflict(f"the callback is {rec.callback.status}; only dead or failed deliveries are replayed",
                       code="callback_not_replayable")
    await svc.store.set_callback_state(request_id, fresh)
    return ApiResponse(202, {"id": request_id, "callback": callback_view(rec.meta.callback, fresh)})


async def list_models(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    out = []
    for spec in svc.settings.models:
        backlog = await svc.backlog(spec.name, spec.lane_names)
        _, stats = await svc.load(spec.name, spec.lane_names[0])
        public = spec.to_public()
        public["workers"] = len({s.worker for s in stats})  # a worker publishes one entry per engine
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
