"""Transport-agnostic handlers: `ApiRequest` in, `ApiResponse` out.

The same functions run behind the Starlette app, an AWS Lambda and a Google Cloud Function. Each parses
the HTTP side (query, headers, body) and calls the caller operations in `shared.operations`, which the
SDK's direct mode calls too. Everything a caller can get wrong is answered with a 4xx and a message;
Redis being unreachable is a 503 with Retry-After; nothing a caller sends produces a 500.
"""

from __future__ import annotations

import dataclasses

import structlog
from redis.exceptions import ResponseError

from gateway import openai_api
from gateway.api import ApiRequest, ApiResponse, BadRequest, Conflict, ServiceUnavailable, wants_events
from gateway.parsing import parse_body, parse_idempotency_key, parse_wait
from gateway.service import GatewayService
from shared import operations as ops
from shared.events import follow, parse_last_event_id, tokens_sent
from shared.messages import REPLAYABLE
from shared.redis_io import UNAVAILABLE, fewest_replicas
from shared.states import Status
from shared.views import callback_view

log = structlog.get_logger(__name__)


def _response(answer: ops.Answer) -> ApiResponse:
    return ApiResponse(answer.status, answer.body, answer.headers)


async def submit(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    spec = ops.model_spec(svc, model)
    wait = parse_wait(req, svc.settings.max_wait_s)
    body = parse_body(req, svc.settings.max_body_bytes)
    key = parse_idempotency_key(req)
    if isinstance(body, dict) and wants_events(req.header("accept"), body.get("stream") is True):
        # the answer is the request's event stream, from its acceptance on
        answer = await ops.submit(svc, body, spec, req.tenant, idempotency_key=key)
        rec = await ops.visible(svc, req.tenant, answer.body["id"])
        if answer.body.get("status") == "queued" and rec.state is Status.RUNNING:
            # a worker started it between the store and this read: the stream still opens with what the submit
            # answered, and announces `running` before the first delta (CI, on a loaded Redis Cluster: it opened
            # with `running`, and the caller never saw its request queued)
            rec = dataclasses.replace(rec, state=Status.QUEUED)
        return ApiResponse(200, headers={**answer.headers, "X-Request-Id": rec.id}, events=follow(svc, rec))
    return _response(await ops.submit(svc, body, spec, req.tenant, wait=wait, idempotency_key=key))


async def submit_batch(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    spec = ops.model_spec(svc, model)
    return _response(await ops.submit_batch(svc, parse_body(req, svc.settings.max_body_bytes), spec, req.tenant,
                                            idempotency_key=parse_idempotency_key(req)))


async def get_request(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    wait = parse_wait(req, svc.settings.max_wait_s)
    return _response(await ops.get(svc, req.tenant, request_id, wait=wait))


async def request_events(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    """Server-Sent Events of a request: status changes, token deltas, the final result (`shared.events`)."""
    try:
        after = parse_last_event_id(req.header("last-event-id") or req.query.get("last_event_id"))
    except ValueError as exc:
        raise BadRequest(str(exc), code="invalid_last_event_id") from exc
    rec = await ops.visible(svc, req.tenant, request_id)
    if after and after > (sent := await tokens_sent(svc, rec)):  # no event of this stream ever had that id
        raise BadRequest(f"Last-Event-ID {after} is past this request's output: an id this API sent is at most "
                         f"{sent} now", code="invalid_last_event_id")
    return ApiResponse(200, events=follow(svc, rec, after))


async def cancel_request(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    return _response(await ops.cancel(svc, req.tenant, request_id))


async def replay_callback(svc: GatewayService, req: ApiRequest, request_id: str) -> ApiResponse:
    """Send a dead-lettered (or failed) webhook again, from attempt zero."""
    rec = await ops.visible(svc, req.tenant, request_id)
    if rec.meta is None or rec.meta.callback is None:
        raise Conflict("this request has no callback: nothing to replay", code="no_callback")  # it exists: not 404
    if rec.callback is None:
        raise Conflict("the callback has not been attempted yet", code="callback_pending")
    now, latest = svc.now_ms(), None
    states = {d.event: d for d in rec.deliveries}
    for d in rec.deliveries:  # every event's delivery that died or failed (a started one, a completed one)
        if d.status in REPLAYABLE and (fresh := await svc.callbacks.replay(d.delivery_id, now)) is not None:
            await svc.store.set_callback_state(request_id, fresh, now)  # the record's latest delivery now
            states[d.event] = latest = fresh
    if latest is None:
        raise Conflict(f"the callback is {rec.callback.status}; only dead or failed deliveries are replayed",
                       code="callback_not_replayable")
    return ApiResponse(202, {"id": request_id,
                             "callback": callback_view(rec.meta.callback, latest, list(states.values()))})


async def list_models(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    out = []
    for spec in svc.settings.models:
        backlog = await svc.backlog(spec.name, spec.lane_names)
        _, stats = await svc.load(spec.name, spec.lane_names[0])
        public = spec.to_public()
        public["limits"].update(ops.effective_limits(svc, spec))
        public["workers"] = len({s.worker for s in stats})  # a worker publishes one entry per engine
        for lane in public["lanes"]:
            name = lane["name"]
            loads = [ln for s in stats for ln in s.lanes if ln.lane == name]
            lane["backlog"] = backlog[name]
            lane["running"] = sum(ln.running for ln in loads)
            lane["service_rate_rps"] = round(sum(ln.completed_rps for ln in loads), 3)
            lane["est_wait_ms"] = round(min(ln.est_wait_ms for ln in loads)) if loads else None
        out.append(public)
    return ApiResponse(200, {"models": out, "object": "list", "data": openai_api.list_data(svc)})


async def healthz(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return ApiResponse(200, {"status": "ok"})


async def _replicas(svc: GatewayService) -> int:
    """The fewest replicas of any master; where INFO is not allowed (an ACL without @dangerous), not a verdict."""
    try:
        return await fewest_replicas(svc.redis)
    except ResponseError as exc:
        log.warning("readiness: cannot read Redis's replication (INFO): not checked", error=str(exc))
        return svc.settings.redis_wait_replicas


async def readyz(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    """Ready: Redis answers, and (durable writes on) has the replicas each submit must reach; else every submit
    would be a 503, and a load balancer should send callers elsewhere."""
    wanted = svc.settings.redis_wait_replicas
    try:
        await svc.ping()
        have = await _replicas(svc) if wanted > 0 else 0
    except UNAVAILABLE as exc:
        raise ServiceUnavailable(f"redis unreachable: {type(exc).__name__}", retry_after=1) from exc
    if have < wanted:
        raise ServiceUnavailable(f"Redis has {have} replica(s) connected; BATCHGATE_REDIS_WAIT_REPLICAS asks each "
                                 f"write to reach {wanted}: every submit would be refused", code="not_replicated",
                                 retry_after=1)
    return ApiResponse(200, {"status": "ready"})
