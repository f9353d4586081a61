"""A thin Starlette app over the handlers. Run it with `batchgate gateway` (uvicorn + uvloop)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway import metrics, openai_api, openapi
from gateway.api import (
    ApiError,
    ApiRequest,
    ApiResponse,
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    answered_once,
    sse_data,
)
from gateway.routes import ROUTES, RouteSpec, dispatch, errors_for, identified
from gateway.service import GatewayService
from shared.config import Settings
from shared.heap import freeze_startup_heap, thaw_heap
from shared.redis_io import UNAVAILABLE
from shared.waiters import Released

log = structlog.get_logger(__name__)

EVENT_PING_S = 15  # a comment line this often keeps idle event streams open through proxies
CANCEL_SETTLE_S = 2.0  # at shutdown, the cancellations of the calls that just ended get this long before Redis closes


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, refusing early (413) once it passes `limit` bytes, and (408) when it has not arrived
    whole within `timeout_s`: a client that sends headers and stalls holds no connection for long."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s", code="body_timeout",
                             headers={"Connection": "close"}) from None
    except ClientDisconnect:  # nobody to answer: nothing was read, nothing done
        raise BadRequest("the client went away before its body was whole", code="client_disconnected") from None
    return b"".join(chunks)


async def stream_body(request: Request, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """The body as it arrives, for a `streamed_body` route (an upload of any length): each chunk must come
    within `idle_timeout_s` of the one before (else 408, the connection closed)."""
    chunks = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeout(f"no part of the request body arrived for {idle_timeout_s:g} s",
                                 code="body_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise BadRequest("the client went away before its body was whole", code="client_disconnected") from None
        if chunk:
            yield chunk


async def _frames(resp: ApiResponse) -> AsyncIterator[ServerSentEvent]:
    """The events of a streamed response; Redis lost mid-stream ends it with an `error` event (the caller
    reconnects with its Last-Event-ID and loses nothing)."""
    assert resp.events is not None
    try:
        async for event in resp.events:
            yield ServerSentEvent(sse_data(event), event=event.event or None, id=event.id or None)
    except UNAVAILABLE as exc:
        log.warning("event stream: redis unavailable", error=repr(exc))
        body = {"error": {"code": "unavailable", "message": "the queue is unreachable; reconnect with Last-Event-ID"}}
        yield ServerSentEvent(json.dumps(body), event="error")
    except Released:
        body = {"error": {"code": "unavailable", "message": "this gateway is shutting down; reconnect with "
                                                            "Last-Event-ID"}}
        yield ServerSentEvent(json.dumps(body), event="error")


async def client_gone(request: Request) -> None:
    """Returns once the client has closed its connection (the body was read whole: what comes next is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _send(resp: ApiResponse, accept: str | None, once_s: float | None = None, path: str = "") -> Response:
    """`once_s`: the app answers once (Lambda, through Mangum): an event stream holds that long at most."""
    resp = identified(resp, path)
    if resp.events is not None:
        if once_s is not None:
            resp = dataclasses.replace(resp, events=answered_once(resp.events, once_s, resp.cut))
        return EventSourceResponse(_frames(resp), status_code=resp.status, headers=resp.headers,
                                   ping=EVENT_PING_S)
    if resp.stream is not None:
        return StreamingResponse(resp.stream, status_code=resp.status, headers=resp.headers,
                                 media_type=resp.media_type)
    body, ctype = resp.render(accept)
    return Response(body, status_code=resp.status, media_type=ctype, headers=resp.headers)


def _endpoint(route: RouteSpec, svc: GatewayService, answers_once: bool):  # type: ignore[no-untyped-def]
    name = route.handler.__name__

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            body = (await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
                    if route.with_body else b"")
            api_req = ApiRequest(
                method=request.method, path=request.url.path, query=dict(request.query_params),
                headers=_headers(request), body=body,
                stream=stream_body(request, svc.settings.body_timeout_s) if route.streamed_body else None,
                gone=None if route.streamed_body else functools.partial(client_gone, request),
            )
            resp = await dispatch(route, svc, api_req, [request.path_params[p] for p in route.params])
        except ApiError as exc:
            resp = route.errors(exc)
        metrics.http_latency(name, resp.status).observe(time.perf_counter() - t0)
        return _send(resp, request.headers.get("accept"), svc.settings.max_wait_s if answers_once else None,
                     request.url.path)

    endpoint.__name__ = name
    return endpoint


def _path_endpoint(routes: list[RouteSpec], svc: GatewayService,  # type: ignore[no-untyped-def]
                   answers_once: bool = False):
    """One Starlette route per path, serving each of its methods: so a 405 names them all in `Allow`."""
    by_method = {r.method: _endpoint(r, svc, answers_once) for r in routes}
    if "GET" in by_method:
        by_method.setdefault("HEAD", by_method["GET"])

    async def endpoint(request: Request) -> Response:
        return await by_method[request.method](request)

    endpoint.__name__ = routes[0].handler.__name__
    return endpoint


def _metrics_endpoint(svc: GatewayService):  # type: ignore[no-untyped-def]
    async def metrics_endpoint(request: Request) -> Response:
        with contextlib.suppress(*UNAVAILABLE):
            for spec in svc.settings.models:
                for lane, n in (await svc.backlog(spec.name, spec.lane_names)).items():
                    metrics.BACKLOG.labels(spec.name, lane).set(n)
        metrics.WAITERS.set(svc.hub.waiting)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return metrics_endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = exc.detail if isinstance(exc, HTTPException) else "internal error"
    if status == 404:
        return _send(errors_for(request.url.path)(NotFound(f"no route {request.method} {request.url.path}")), None,
                     path=request.url.path)
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    if status == 405:
        allowed = headers.get("Allow") or headers.get("allow") or ""
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        # in the shape of the path's routes (OpenAI's on its routes), `Allow` kept
        return _send(errors_for(request.url.path)(MethodNotAllowed(message, headers={"Allow": allowed})), None,
                     path=request.url.path)
    return _send(ApiResponse(status, {"error": {"code": codes.get(status, "error"), "message": message}},
                             headers), None, path=request.url.path)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path)
    return _send(ApiResponse(500, {"error": {"code": "internal", "message": "internal error"}}), None,
                 path=request.url.path)


# headers whose value decides who calls, which request a call is or where its stream resumes: sent twice with two
# values, which one was meant is not known (the last one won: a call could run as the other tenant, or under the
# other key, or a stream resume elsewhere than its caller's place)
SINGLE_HEADERS = ("authorization", "x-api-key", "idempotency-key", "last-event-id")


def _headers(request: Request) -> dict[str, str]:
    """The request's headers by lower-case name, in one pass (a repeated name: its last value)."""
    out: dict[str, str] = {}
    for name, v in request.headers.items():
        k = name.lower()
        if k in SINGLE_HEADERS and out.get(k, v) != v:
            raise BadRequest(f"the {k} header is sent more than once, with different values: send one",
                             code="repeated_header")
        out[k] = v
    return out


def create_app(settings: Settings | None = None, *, service: GatewayService | None = None,
               answers_once: bool = False) -> Starlette:
    """`answers_once`: the app serves a transport that answers once (Lambda, through Mangum): an event stream is
    held to `max_wait_s` (`gateway.api.answered_once`)."""
    settings = settings or (service.settings if service else Settings.from_environ())
    svc = service or GatewayService(settings)
    spec = openapi.document(settings)
    page = openapi.docs_page(spec)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not svc.auth.enabled:
            log.warning("AUTH IS OFF (BATCHGATE_AUTH=off): every caller is tenant 'default'; for local use only")
        await svc.start()
        log.info("start-up heap frozen", objects=freeze_startup_heap())
        try:
            yield
        finally:
            await openai_api.settle_cancellations(CANCEL_SETTLE_S)
            await svc.close()
            thaw_heap()

    async def openapi_endpoint(request: Request) -> Response:
        return JSONResponse(spec)

    async def docs_endpoint(request: Request) -> Response:
        return HTMLResponse(page)

    paths: dict[str, list[RouteSpec]] = {}
    for r in ROUTES:
        paths.setdefault(r.path, []).append(r)
    routes = [Route(path, _path_endpoint(group, svc, answers_once), methods=[r.method for r in group])
              for path, group in paths.items()]
    routes += [Route("/openapi.json", openapi_endpoint, methods=["GET"]),
               Route("/docs", docs_endpoint, methods=["GET"])]
    if not answers_once:  # a function's metrics are one container's, which nothing can scrape; and its URL is public
        routes.append(Route("/metrics", _metrics_endpoint(svc), methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.service = svc
    return app
