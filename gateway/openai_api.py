"""OpenAI-compatible routes: `POST /v1/completions`, `/v1/chat/completions`, `/v1/embeddings` and
`GET /v1/models/{model}`, so OpenAI's SDKs work with `base_url` set to the gateway's `/v1`.

Each translates its body into the native submit body (`shared.openai_shapes`) and goes through
`shared.operations.submit`: the same validation, deadlines, lanes, admission, tenant limits and
idempotency keys as the native API. Then it waits for the result (up to the request's deadline, at most
the gateway's `max_wait_s`) or, with `stream: true`, follows the request's events (`shared.events`) and
sends them as OpenAI's chunks. Every error on these routes is in OpenAI's shape (docs/openai.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog

from gateway import metrics
from gateway.api import ApiError, ApiRequest, ApiResponse
from gateway.parsing import parse_body, parse_idempotency_key
from gateway.service import GatewayService
from shared import openai_shapes as oa
from shared import operations as ops
from shared.events import ServerEvent, follow
from shared.records import StoredRecord
from shared.redis_io import UNAVAILABLE
from shared.states import Task
from shared.views import record_view

log = structlog.get_logger(__name__)

WAIT_MARGIN_S = 0.25  # past the deadline and its grace, the record is terminal (expired) when read
DONE = ServerEvent("", "[DONE]", "")  # sent as it is: `data: [DONE]` (`ServerEvent.data` may be a str)
_abandoned: set[asyncio.Task[None]] = set()  # cancellations of streams whose caller went away


def openai_error(err: oa.OpenAIError) -> ApiResponse:
    metrics.ERRORS.labels(err.code or str(err.status)).inc()
    return ApiResponse(err.status, err.body(), err.headers())


def error_response(exc: ApiError) -> ApiResponse:
    """A native error (raised before the route's own code ran: the API key, the body's size) in OpenAI's
    shape; for `RouteSpec.errors` of these routes."""
    return openai_error(oa.from_api_error(exc))


async def _answer(work: Callable[[], Awaitable[ApiResponse]],
                  aliases: Callable[[], dict[str, str]] = dict) -> ApiResponse:
    """Run a route's work; every error it raises in OpenAI's shape."""
    try:
        return await work()
    except oa.OpenAIError as err:
        return openai_error(err)
    except ApiError as exc:
        return openai_error(oa.from_api_error(exc, aliases()))
    except UNAVAILABLE as exc:
        log.warning("redis unavailable", error=repr(exc))
        return openai_error(oa.OpenAIError(503, "the queue is unreachable; retry shortly", code="unavailable",
                                           retry_after=1, headers={"Retry-After": "1"}))


async def answer_openai(work: Callable[[], Awaitable[ApiResponse]]) -> ApiResponse:
    """A route's work with every error it raises in OpenAI's shape (for the other OpenAI-shaped routes)."""
    return await _answer(work)


def _translate(svc: GatewayService, req: ApiRequest,
               translate: Callable[..., oa.Translated]) -> oa.Translated:
    body = parse_body(req, svc.settings.max_body_bytes)
    return translate(body, timeout_header=req.header(oa.TIMEOUT_HEADER))


def _spec_for(svc: GatewayService, tr: oa.Translated, task: Task) -> Any:
    try:
        spec = ops.model_spec(svc, tr.model)
    except ApiError as exc:
        raise oa.OpenAIError(404, exc.message, code="model_not_found", param="model") from None
    if spec.task is not task:
        route = "/v1/embeddings" if spec.task is Task.EMBED else "/v1/completions or /v1/chat/completions"
        raise oa.invalid("model", f"{tr.model!r} is {spec.task.model_kind}: use {route}", code="wrong_model_task")
    return spec


async def _submit(svc: GatewayService, req: ApiRequest, tr: oa.Translated, task: Task) -> ops.Answer:
    spec = _spec_for(svc, tr, task)
    return await ops.submit(svc, tr.body, spec, req.tenant, idempotency_key=parse_idempotency_key(req))


async def _result(svc: GatewayService, answer: ops.Answer) -> dict[str, Any]:
    """The record view of a submitted request once terminal: waited for up to its deadline (and the grace
    a worker has to write its result), at most the gateway's `max_wait_s`."""
    view = answer.body
    if view.get("status") in ("succeeded", "failed", "expired", "cancelled"):
        return view  # an idempotent replay of a finished request
    request_id = str(view["id"])
    deadline = float(view.get("deadline") or svc.clock())
    wait = max(0.0, min(svc.settings.max_wait_s,
                        deadline + svc.settings.expiry_grace_s + WAIT_MARGIN_S - svc.clock()))
    rec = await svc.wait(request_id, wait)
    if rec is None or not rec.terminal:
        raise oa.OpenAIError(
            504, f"no result within {wait:.3g} s (the gateway's longest wait); request {request_id} goes on: "
                 f"GET /v1/requests/{request_id} for its result", code="wait_exceeded", retry=False,
            headers={"X-Request-Id": request_id})
    return record_view(rec)


async def completions(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return await _generate(svc, req, oa.translate_completion)


async def chat_completions(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return await _generate(svc, req, oa.translate_chat)


async def _generate(svc: GatewayService, req: ApiRequest, translate: Callable[..., oa.Translated]) -> ApiResponse:
    state: dict[str, oa.Translated] = {}

    async def work() -> ApiResponse:
        tr = state["tr"] = _translate(svc, req, translate)
        created = int(svc.clock())
        answer = await _submit(svc, req, tr, Task.GENERATE)
        request_id = str(answer.body["id"])
        headers = {"X-Request-Id": request_id}
        if tr.stream:
            rec = await ops.visible(svc, req.tenant, request_id)
            chunks = oa.ChunkMaker(tr, request_id, created)
            return ApiResponse(200, headers=headers, events=_stream(svc, req.tenant, rec, chunks))
        view = await _result(svc, answer)
        error = oa.result_error(view)
        if error is not None:
            raise error
        return ApiResponse(200, oa.completion_response(tr, view, created), headers)

    return await _answer(work, lambda: state["tr"].aliases if "tr" in state else {})


def _data(chunk: dict[str, Any]) -> ServerEvent:
    return ServerEvent("", chunk, "")


async def _stream(svc: GatewayService, tenant: str, rec: StoredRecord,
                  chunks: oa.ChunkMaker) -> AsyncIterator[ServerEvent]:
    """A request's events as OpenAI's chunks: the first (chat), one per text delta, the last with the
    finish_reason (and the usage chunk), then `[DONE]`. A result without an answer (cancelled, failed,
    expired before any output) ends it with `{"error": ...}`, which OpenAI's clients raise."""
    finished = False
    try:
        first = chunks.first()
        if first is not None:
            yield _data(first)
        async for event in follow(svc, rec):
            if event.event == "delta" and event.data.get("text"):
                yield _data(chunks.text(str(event.data["text"])))
            elif event.event == "done":
                finished = True
                error = oa.result_error(event.data)
                for chunk in [error.body()] if error else chunks.final(event.data):
                    yield _data(chunk)
                yield DONE
                return
    finally:
        if not finished:  # the caller went away (or the stream broke): stop computing for nobody
            task = asyncio.get_running_loop().create_task(_cancel_quietly(svc, tenant, rec.id))
            _abandoned.add(task)
            task.add_done_callback(_abandoned.discard)


async def _cancel_quietly(svc: GatewayService, tenant: str, request_id: str) -> None:
    with contextlib.suppress(Exception):
        await ops.cancel(svc, tenant, request_id)
        log.info("stream abandoned: request cancelled", request_id=request_id)


async def embeddings(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    state: dict[str, oa.Translated] = {}

    async def work() -> ApiResponse:
        tr = state["tr"] = _translate(svc, req, oa.translate_embeddings)
        answer = await _submit(svc, req, tr, Task.EMBED)
        view = await _result(svc, answer)
        error = oa.result_error(view)
        if error is not None:
            raise error
        return ApiResponse(200, oa.embedding_response(tr, view), {"X-Request-Id": str(view["id"])})

    return await _answer(work, lambda: state["tr"].aliases if "tr" in state else {})


async def retrieve_model(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    async def work() -> ApiResponse:
        if svc.settings.model(model) is None:
            raise oa.OpenAIError(404, f"the model {model!r} does not exist", code="model_not_found", param="model")
        return ApiResponse(200, oa.model_entry(model))

    return await _answer(work)


def list_data(svc: GatewayService) -> list[dict[str, Any]]:
    """`data` of `GET /v1/models` in OpenAI's shape (`handlers.list_models` adds it to its answer)."""
    return oa.model_list([spec.name for spec in svc.settings.models])
