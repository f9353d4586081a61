"""The route table, defined once: the Starlette app, the Cloud Functions adapter and the OpenAPI
document are all built from it, so every transport serves the same handlers at the same paths."""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway import batch_api, files_api, handlers, metrics, openai_api
from gateway.api import (
    ApiError,
    ApiRequest,
    ApiResponse,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    collect_events,
    error_response,
    one_chunk,
)
from gateway.service import GatewayService
from shared.api_errors import unavailable
from shared.redis_io import UNAVAILABLE

Handler = Callable[..., Awaitable[ApiResponse]]


@dataclass(frozen=True)
class RouteSpec:
    method: str
    path: str  # Starlette syntax: /v1/requests/{request_id}
    handler: Handler
    with_body: bool = False
    # the handler reads the body as it arrives (`ApiRequest.stream`), under its own limits: an upload, never
    # held whole (not read through the app's `read_body` and its `max_body_bytes`)
    streamed_body: bool = False
    public: bool = False  # served without an API key
    params: tuple[str, ...] = field(default=())
    pattern: re.Pattern[str] = field(default=re.compile(""), compare=False)
    errors: Callable[[ApiError], ApiResponse] = field(default=error_response, compare=False)  # the error shape

    @classmethod
    def make(cls, method: str, path: str, handler: Handler, **kw: Any) -> RouteSpec:
        params = tuple(re.findall(r"{(\w+)}", path))
        escaped = re.escape(path).replace(r"\{", "{").replace(r"\}", "}")
        escaped = re.escape(path).replace(r"\{", "{").replace(r"\}", "}")
        regex = "^" + re.sub(r"{(\w+)}", r"(?P<\1>[^/]+)", escaped) + "$"
        return cls(method, path, handler, params=params, pattern=re.compile(regex), **kw)


OPENAI: dict[str, Any] = {"errors": openai_api.error_response}  # errors in OpenAI's shape on its routes

ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec.make("POST", "/v1/models/{model}/requests", handlers.submit, with_body=True),
    RouteSpec.make("POST", "/v1/models/{model}/requests:batch", handlers.submit_batch, with_body=True),
    RouteSpec.make("GET", "/v1/requests/{request_id}", handlers.get_request),
    RouteSpec.make("DELETE", "/v1/requests/{request_id}", handlers.cancel_request),
    RouteSpec.make("GET", "/v1/requests/{request_id}/events", handlers.request_events),
    RouteSpec.make("POST", "/v1/requests/{request_id}/callback:replay", handlers.replay_callback),
    RouteSpec.make("GET", "/v1/models", handlers.list_models, **OPENAI),  # native body; errors a superset of both
    RouteSpec.make("GET", "/v1/models/{model}", openai_api.retrieve_model, **OPENAI),
    RouteSpec.make("POST", "/v1/completions", openai_api.completions, with_body=True, **OPENAI),
    RouteSpec.make("POST", "/v1/chat/completions", openai_api.chat_completions, with_body=True, **OPENAI),
    RouteSpec.make("POST", "/v1/responses", openai_api.responses, with_body=True, **OPENAI),
    RouteSpec.make("POST", "/v1/embeddings", openai_api.embeddings, with_body=True, **OPENAI),
    RouteSpec.make("POST", "/v1/files", files_api.create_file, streamed_body=True, **OPENAI),
    RouteSpec.make("GET", "/v1/files", files_api.list_files, **OPENAI),
    RouteSpec.make("GET", "/v1/files/{file_id}", files_api.retrieve_file, **OPENAI),
    RouteSpec.make("DELETE", "/v1/files/{file_id}", files_api.delete_file, **OPENAI),
    RouteSpec.make("GET", "/v1/files/{file_id}/content", files_api.file_content, **OPENAI),
    RouteSpec.make("POST", "/v1/batches", batch_api.create_batch, with_body=True, **OPENAI),
    RouteSpec.make("GET", "/v1/batches", batch_api.list_batches, **OPENAI),
    RouteSpec.make("GET", "/v1/batches/{batch_id}", batch_api.get_batch, **OPENAI),
    RouteSpec.make("POST", "/v1/batches/{batch_id}/cancel", batch_api.cancel_batch, **OPENAI),
    RouteSpec.make("GET", "/healthz", handlers.healthz, public=True),
    RouteSpec.make("GET", "/readyz", handlers.readyz, public=True),
)


def match(method: str, path: str) -> tuple[RouteSpec, list[str]]:
    """The route for a request and its path arguments; 404 or 405 otherwise."""
    allowed = []
    for route in ROUTES:
        m = route.pattern.match(path)
        if m is None:
            continue
        if route.method == method:
            return route, [m.group(p) for p in route.params]
        allowed += [route.method, "HEAD"] if route.method == "GET" else [route.method]  # HEAD as the HTTP app
    if allowed:
        raise MethodNotAllowed(f"{method} is not allowed on {path} (allowed: {', '.join(allowed)})",
                               headers={"Allow": ", ".join(allowed)})
    raise NotFound(f"no route {method} {path}")


def errors_for(path: str) -> Callable[[ApiError], ApiResponse]:
    """The error shape of the routes at `path` (OpenAI's on its routes), for errors raised before one of them
    is chosen (a 405); where no route has the path, both shapes at once (`no_route_response`)."""
    return next((r.errors for r in ROUTES if r.pattern.match(path)), no_route_response)


def no_route_response(exc: ApiError) -> ApiResponse:
    """An error at a path no route has (an OpenAI route this gateway lacks, such as /v1/responses, as well as a
    mistyped native one): the native body with OpenAI's `type` and `param` too, so either kind of client reads it."""
    return ApiResponse(exc.status, {"error": {**exc.body()["error"], "type": "invalid_request_error", "param": None}},
                       exc.headers())


log = structlog.get_logger(__name__)


def identified(resp: ApiResponse, path: str = "") -> ApiResponse:
    """An error answer with an `X-Request-Id` as every answer has (OpenAI's clients show it with the error): a call
    refused before it became a request has no request id, so it gets an `err_` id of its own, logged with the error
    (never a request id: `GET /v1/requests/{id}` would call it unknown, then gone)."""
    if resp.status < 400 or any(k.lower() == "x-request-id" for k in resp.headers):
        return resp
    error_id = "err_" + secrets.token_hex(10)
    err = resp.body.get("error") if isinstance(resp.body, dict) else None
    log.info("call refused", error_id=error_id, status=resp.status, path=path,
             code=err.get("code") if isinstance(err, dict) else None)
    return dataclasses.replace(resp, headers={**resp.headers, "X-Request-Id": error_id})


async def dispatch(route: RouteSpec, svc: GatewayService, req: ApiRequest, args: list[str],
                   trusted_tenant: str | None = None) -> ApiResponse:
    """Authenticate, run the handler, translate errors: in exactly one place for every transport.

    `trusted_tenant`: the caller was authenticated outside HTTP (an IAM-authorised Lambda invocation)."""
    try:
        if trusted_tenant is not None:
            req = dataclasses.replace(req, tenant=trusted_tenant)
        elif not route.public:
            req = dataclasses.replace(req, tenant=await svc.auth.tenant_for(req))
        return await route.handler(svc, req, *args)
    except ApiError as exc:
        metrics.ERRORS.labels(exc.code).inc()
        return route.errors(exc)
    except UNAVAILABLE as exc:
        metrics.ERRORS.labels("unavailable").inc()
        log.warning("redis unavailable", error=repr(exc))
        return route.errors(unavailable(exc))
    finally:
        structlog.contextvars.clear_contextvars()


async def handle(svc: GatewayService, req: ApiRequest, trusted_tenant: str | None = None) -> ApiResponse:
    """Route and dispatch a transport-neutral request (Cloud Functions, Lambda direct calls, tests)."""
    try:
        route, args = match(req.method, req.path)
    except ApiError as exc:
        return identified(errors_for(req.path)(exc), req.path)
    if route.with_body and len(req.body) > svc.settings.max_body_bytes:
        return identified(route.errors(PayloadTooLarge(f"body exceeds the limit of {svc.settings.max_body_bytes} "
                                                       "bytes")), req.path)
    if route.streamed_body and req.stream is None:
        req = dataclasses.replace(req, stream=one_chunk(req.body))
    resp = await collect_events(await dispatch(route, svc, req, args, trusted_tenant), svc.settings.max_wait_s)
    return identified(resp, req.path)
