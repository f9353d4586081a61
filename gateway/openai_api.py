"""OpenAI-compatible routes: `POST /v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/embeddings` and
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
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog

from gateway import metrics
from gateway.api import ApiError, ApiRequest, ApiResponse
from gateway.parsing import parse_body, parse_idempotency_key
from gateway.service import GatewayService
from shared import openai_responses as oar
from shared import openai_shapes as oa
from shared import operations as ops
from shared.api_errors import unavailable
from shared.config import ModelSpec
from shared.events import ServerEvent, follow
from shared.idempotency_keys import derived_key
from shared.records import StoredRecord
from shared.redis_io import UNAVAILABLE
from shared.states import Task
from shared.views import record_view
from shared.waiters import Released

log = structlog.get_logger(__name__)

CHOICE_IDS_HEADER = "X-Batchgate-Request-Ids"  # with several choices (`n`): each one's request id, in order
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
        down = unavailable(exc)
        return openai_error(oa.OpenAIError(503, down.message, code=down.code, retry_after=1,
                                           headers={"Retry-After": "1"}))


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


async def _submit_choices(svc: GatewayService, req: ApiRequest, tr: oa.Translated) -> list[ops.Answer]:
    """One native request per choice (`n`), batched together on the worker like any others. The first takes the
    whole call's share of the tenant's rate (a call that does not fit is refused before any choice is accepted);
    more choices than the tenant's backlog quota can never fit, and are refused for good. An Idempotency-Key keys
    the first choice as it is and the next ones with `derived_key(key, i)`, each with the call's number of choices
    in what a retry must repeat (another `n` or `best_of` is another call: 409). If a choice is refused all the same
    (the quota, admission), the call is: the choices accepted before it are cancelled, unless a key lets a retry
    find them."""
    spec = _spec_for(svc, tr, Task.GENERATE)
    key = parse_idempotency_key(req)
    if tr.requests > 1 and (quota := await svc.limits.max_backlog(req.tenant)) is not None and tr.requests > quota:
        raise oa.invalid("n" if tr.best_of <= tr.n else "best_of",
                         f"{tr.requests} choices are more requests than this tenant may have queued or running at "
                         f"once ({quota})", code="tenant_backlog_exceeded")
    answers: list[ops.Answer] = []
    try:
        for i, body in enumerate(tr.bodies()):
            answers.append(await ops.submit(svc, body, spec, req.tenant, rate_tokens=tr.requests if i == 0 else 0,
                                            idempotency_key=key if key is None or i == 0 else derived_key(key, i),
                                            call=f"choices={tr.requests}" if tr.requests > 1 else ""))
    except BaseException:
        if key is None:
            for answer in answers:
                _abandon(svc, req.tenant, str(answer.body["id"]))
        raise
    return answers


def _wait_budget(svc: GatewayService, answers: list[ops.Answer]) -> float:
    """Until when a call waits for its results: its requests' deadline (and the grace a worker has to write its
    result), at most the gateway's `max_wait_s` from now."""
    deadline = max(float(a.body.get("deadline") or svc.clock()) for a in answers)
    return svc.clock() + max(0.0, min(svc.settings.max_wait_s,
                                      deadline + svc.settings.expiry_grace_s + WAIT_MARGIN_S - svc.clock()))


async def _answers(svc: GatewayService, req: ApiRequest, answers: list[ops.Answer]) -> list[dict[str, Any]]:
    """The record view of each submitted request once it has an answer (see `_result`), within one budget. The
    first without one (an error) is the call's error: the others, and all of them when the caller goes away
    meanwhile, are cancelled, since they compute for nobody (a caller gone from a keyed call leaves them all for
    its retry, `_keyed`)."""
    until = _wait_budget(svc, answers)
    views = []
    for i, answer in enumerate(answers):
        try:
            view = await _result(svc, req, answer, until)
            if (error := oa.result_error(view)) is not None:
                raise error
        except oa.OpenAIError as err:
            ids = _ids(answers)
            if err.code == "wait_exceeded" and len(answers) > 1:  # they go on, each for GET /v1/requests/{id}
                raise oa.OpenAIError(504, f"no result for every choice within the gateway's longest wait; requests "
                                          f"{', '.join(ids)} go on: GET /v1/requests/{{id}} for their results",
                                     code="wait_exceeded", retry=False,
                                     headers={"X-Request-Id": ids[0], CHOICE_IDS_HEADER: ",".join(ids)}) from None
            if err.code == "unavailable" and svc.hub.released:  # this gateway is leaving: every choice goes on or none
                if not _keyed(req):  # (choice i: `_result` cancelled it)
                    _abandon_all(svc, req.tenant, ids[i + 1:], "gateway shutting down")
                raise _shutting_down(ids, _keyed(req)) from None
            if not (err.code == "client_closed" and _keyed(req)):  # (a caller gone: `_result` cancelled its own)
                _abandon_all(svc, req.tenant, ids[i + 1:])
            raise
        except BaseException:  # the queue unreachable, the call's task cancelled: nobody will read them (but a retry)
            if not _keyed(req):
                _abandon_all(svc, req.tenant, _ids(answers[i:]))
            raise
        views.append(view)
    return views


def _ids(answers: list[ops.Answer]) -> list[str]:
    return [str(a.body["id"]) for a in answers]


def _abandon_all(svc: GatewayService, tenant: str, request_ids: list[str], reason: str = "caller gone") -> None:
    for request_id in request_ids:
        _abandon(svc, tenant, request_id, reason)


async def _result(svc: GatewayService, req: ApiRequest, answer: ops.Answer,
                  until: float | None = None) -> dict[str, Any]:
    """The record view of a submitted request once terminal: waited for up to its deadline (and the grace
    a worker has to write its result), at most the gateway's `max_wait_s` (or `until`). A caller that goes away
    meanwhile (a client's timeout) has its request cancelled, as a stream's caller has: OpenAI's clients retry a
    timeout as a new request, and each would otherwise be computed in full for nobody."""
    view = answer.body
    if view.get("status") in ("succeeded", "failed", "expired", "cancelled"):
        return view  # an idempotent replay of a finished request
    request_id = str(view["id"])
    wait = max(0.0, (_wait_budget(svc, [answer]) if until is None else until) - svc.clock())
    rec = await _wait_while_there(svc, req, request_id, wait)
    if (rec is None or not rec.terminal) and svc.hub.released:
        if not _keyed(req):
            _abandon(svc, req.tenant, request_id, "gateway shutting down")
        raise _shutting_down([request_id], _keyed(req))
    if rec is None or not rec.terminal:
        raise oa.OpenAIError(
            504, f"no result within {wait:.3g} s (the gateway's longest wait); request {request_id} goes on: "
                 f"GET /v1/requests/{request_id} for its result", code="wait_exceeded", retry=False,
            headers={"X-Request-Id": request_id})
    return record_view(rec)


async def _wait_while_there(svc: GatewayService, req: ApiRequest, request_id: str, wait: float) -> StoredRecord | None:
    if req.gone is None:
        return await svc.wait(request_id, wait)
    waiting, gone = asyncio.ensure_future(svc.wait(request_id, wait)), asyncio.ensure_future(req.gone())
    try:
        await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiting, gone):
            task.cancel()  # none of a finished task's doing
        await asyncio.gather(waiting, gone, return_exceptions=True)
    if not waiting.cancelled():  # a result (or the wait's error) wins over a caller gone at the same moment
        return waiting.result()
    if _keyed(req):
        raise oa.OpenAIError(499, f"the client closed its connection; request {request_id} goes on, for a retry "
                                  "with the same Idempotency-Key to find", code="client_closed")
    _abandon(svc, req.tenant, request_id)
    raise oa.OpenAIError(499, "the client closed its connection: the request was cancelled", code="client_closed")


def _keyed(req: ApiRequest) -> bool:
    """The call carries an Idempotency-Key: its retry finds its requests (going on, or with their result), so a
    caller gone (a timeout, a dropped connection, a stream closed) leaves them running instead of cancelling them
    for nobody, which would answer every retry with the cancellation."""
    return req.header("idempotency-key") is not None


async def completions(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return await _generate(svc, req, oa.translate_completion)


async def chat_completions(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    return await _generate(svc, req, functools.partial(oa.translate_chat, parser_of=lambda m: _tool_parser(svc, m)))


def _tool_parser(svc: GatewayService, model: str) -> str:
    """A model's tool-call format, which tool_choice "auto" needs ("": none); no such model: 404."""
    try:
        return ops.model_spec(svc, model).tool_call_parser
    except ApiError as exc:
        raise oa.OpenAIError(404, exc.message, code="model_not_found", param="model") from None


async def _generate(svc: GatewayService, req: ApiRequest, translate: Callable[..., oa.Translated]) -> ApiResponse:
    state: dict[str, oa.Translated] = {}

    async def work() -> ApiResponse:
        tr = state["tr"] = _translate(svc, req, translate)
        created = int(svc.clock())
        answers = await _submit_choices(svc, req, tr)
        ids = [str(a.body["id"]) for a in answers]
        headers = {"X-Request-Id": ids[0]} | ({CHOICE_IDS_HEADER: ",".join(ids)} if len(ids) > 1 else {})
        if tr.stream:
            try:
                recs = [await ops.visible(svc, req.tenant, request_id) for request_id in ids]
            except BaseException:  # no stream will follow them (but a retry's)
                if not _keyed(req):
                    _abandon_all(svc, req.tenant, _ids(answers))
                raise
            makers = [oa.ChunkMaker(tr, ids[0], created, i, own_id=ids[i]) for i in range(len(ids))]
            keyed = _keyed(req)
            return ApiResponse(200, headers=headers, events=_stream(svc, req.tenant, recs, makers, keyed=keyed),
                               cut=lambda: _data(_cut(svc, ids, keyed).body()))
        return ApiResponse(200, oa.completion_response(tr, await _answers(svc, req, answers), created), headers)

    return await _answer(work, lambda: state["tr"].aliases if "tr" in state else {})


async def responses(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    """OpenAI's Responses API, served as a chat completion (`shared.openai_responses`)."""
    state: dict[str, oa.Translated] = {}

    async def work() -> ApiResponse:
        call = oar.translate_response(parse_body(req, svc.settings.max_body_bytes),
                                      timeout_header=req.header(oa.TIMEOUT_HEADER),
                                      parser_of=lambda m: _tool_parser(svc, m))
        state["tr"] = call.chat
        created = int(svc.clock())
        answers = await _submit_choices(svc, req, call.chat)
        request_id = str(answers[0].body["id"])
        if call.chat.stream:
            try:
                rec = await ops.visible(svc, req.tenant, request_id)
            except BaseException:  # no stream will follow it (but a retry's)
                if not _keyed(req):
                    _abandon_all(svc, req.tenant, _ids(answers))
                raise
            events = oar.ResponseEvents(call, request_id, created)
            keyed = _keyed(req)
            return ApiResponse(200, headers={"X-Request-Id": request_id},
                               events=_response_stream(svc, req.tenant, rec, events, keyed=keyed),
                               cut=lambda: _typed(events.failed(_cut(svc, [request_id], keyed))[0]))
        (view,) = await _answers(svc, req, answers)
        return ApiResponse(200, oar.response_object(call, view, created), {"X-Request-Id": request_id})

    return await _answer(work, lambda: state["tr"].aliases if "tr" in state else {})


def _typed(event: dict[str, Any]) -> ServerEvent:
    """A Responses API event, named by its type as OpenAI sends it."""
    return ServerEvent(str(event["type"]), event, "")


async def _response_stream(svc: GatewayService, tenant: str, rec: StoredRecord, events: oar.ResponseEvents, *,
                           keyed: bool = False) -> AsyncIterator[ServerEvent]:
    """A request's events as the Responses API's: created, the text and calls as they come, completed; a result
    without an answer ends it with `response.failed`. A caller gone cancels the request, unless the call is
    `keyed` (`_keyed`)."""
    finished = False
    reason = "caller gone"
    try:
        for event in events.first():
            yield _typed(event)
        async with contextlib.aclosing(follow(svc, rec)) as followed:
            async for event in followed:
                if event.event == "delta":
                    for out in events.delta(event.data):
                        yield _typed(out)
                elif event.event == "done":
                    finished = True
                    error = oa.result_error(event.data)
                    for out in events.failed(error) if error is not None else events.final(event.data):
                        yield _typed(out)
                    return
    except Released:  # the gateway is shutting down: the response fails, saying what its caller can do
        reason = "gateway shutting down"
        for out in events.failed(_shutting_down([rec.id], keyed)):
            yield _typed(out)
    finally:
        if not finished and not keyed:  # the caller went away, or the stream broke: stop computing
            _abandon(svc, tenant, rec.id, reason)


def _cut(svc: GatewayService, ids: list[str], keyed: bool = False) -> oa.OpenAIError:
    """What ends a stream a transport that answers once (Lambda, Cloud Functions) cuts at the gateway's longest
    wait: OpenAI's clients cannot reconnect, so its requests are cancelled (unless the call's Idempotency-Key lets a
    retry find them), and the caller is told how to fit."""
    fate = "going on for a retry with the same Idempotency-Key" if keyed else "cancelled"
    return oa.OpenAIError(504, f"this gateway answers a stream once, with what its longest wait "
                               f"({svc.settings.max_wait_s:g} s) brings: the stream was cut there and its request "
                               f"{', '.join(ids)} {fate}; ask for fewer tokens, or run the gateway with a longer "
                               "BATCHGATE_MAX_WAIT_S (and function timeout)", code="wait_exceeded", retry=False)


def _data(chunk: dict[str, Any]) -> ServerEvent:
    return ServerEvent("", chunk, "")


async def _stream(svc: GatewayService, tenant: str, recs: list[StoredRecord], makers: list[oa.ChunkMaker], *,
                  keyed: bool = False) -> AsyncIterator[ServerEvent]:
    """The events of a call's requests (one per choice) as OpenAI's chunks: the first of each choice (chat),
    one per text delta as they come, each choice's last with its finish_reason, then (with include_usage) the
    usage chunk and `[DONE]`. A result without an answer (cancelled, failed, expired before any output) ends
    the stream with `{"error": ...}`, which OpenAI's clients raise, and cancels the other choices. A caller gone
    cancels the requests, unless the call is `keyed` (`_keyed`)."""
    finished: dict[int, dict[str, Any]] = {}
    reason = "caller gone"
    try:
        for first in [chunk for maker in makers for chunk in maker.opening()]:
            yield _data(first)
        async with contextlib.aclosing(_merged(svc, recs)) as merged:
            async for i, event in merged:
                if event.event == "delta":
                    for chunk in makers[i].delta(event.data):
                        yield _data(chunk)
                elif event.event == "done":
                    finished[i] = event.data
                    if (error := oa.result_error(event.data)) is not None:
                        keyed = False  # the call failed: a retry fails alike, so the other choices compute for nobody
                        yield _data(error.body())
                        yield DONE
                        return
                    for chunk in makers[i].final(event.data, with_usage=len(recs) == 1):
                        yield _data(chunk)
                    if len(finished) == len(recs):
                        break
        if len(recs) > 1 and makers[0].tr.include_usage:
            yield _data(makers[0].usage_chunk([finished[i] for i in range(len(recs))]))
        yield DONE
    except Released:  # the gateway is shutting down: an OpenAI error, saying what its caller can do, then [DONE]
        reason = "gateway shutting down"
        yield _data(_shutting_down([rec.id for i, rec in enumerate(recs) if i not in finished], keyed).body())
        yield DONE
    finally:  # the caller went away (or the stream broke, or a choice failed, or the gateway is leaving)
        _abandon_all(svc, tenant, [] if keyed else [rec.id for i, rec in enumerate(recs) if i not in finished], reason)


async def _merged(svc: GatewayService, recs: list[StoredRecord]) -> AsyncIterator[tuple[int, ServerEvent]]:
    """The events of several requests as they come, each with its request's index (one request: its own)."""
    if len(recs) == 1:
        async for event in follow(svc, recs[0]):
            yield 0, event
        return
    events: asyncio.Queue[tuple[int, ServerEvent | Exception]] = asyncio.Queue()

    async def pump(i: int, rec: StoredRecord) -> None:
        try:
            async for event in follow(svc, rec):
                events.put_nowait((i, event))
        except Exception as exc:  # raised where the events are read
            events.put_nowait((i, exc))

    pumps = [asyncio.ensure_future(pump(i, rec)) for i, rec in enumerate(recs)]
    try:
        while True:
            i, event = await events.get()
            if isinstance(event, Exception):
                raise event
            yield i, event
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _shutting_down(ids: list[str], keyed: bool) -> oa.OpenAIError:
    """What ends an OpenAI call waiting (a stream has no event ids to resume from) when this gateway shuts down:
    its requests are cancelled, unless the call's Idempotency-Key lets the same call sent again find them. A 503
    OpenAI's clients retry by themselves (the load balancer sends the retry to another gateway)."""
    fate = ("go on: send the call again with the same Idempotency-Key to get their output" if keyed
            else "were cancelled: send the call again")
    headers = {"Retry-After": "1", "X-Request-Id": ids[0]} if ids else {"Retry-After": "1"}
    if len(ids) > 1:
        headers[CHOICE_IDS_HEADER] = ",".join(ids)
    return oa.OpenAIError(503, f"this gateway is shutting down; request(s) {', '.join(ids)} {fate}",
                          code="unavailable", retry=True, headers=headers)


def _abandon(svc: GatewayService, tenant: str, request_id: str, reason: str = "caller gone") -> None:
    """Cancel a request its caller went away from (or this gateway is leaving), in the background (the caller's
    task is ending)."""
    task = asyncio.get_running_loop().create_task(_cancel_quietly(svc, tenant, request_id, reason))
    _abandoned.add(task)
    task.add_done_callback(_abandoned.discard)


async def settle_cancellations(timeout_s: float) -> None:
    """Let the cancellations started in the background finish before the gateway closes its Redis connections (at
    shutdown a call's requests are cancelled as its stream or wait ends, a moment before): each has at most
    `timeout_s`; one that cannot finish in it is left to the request's deadline."""
    if _abandoned:
        await asyncio.wait(set(_abandoned), timeout=timeout_s)


async def _cancel_quietly(svc: GatewayService, tenant: str, request_id: str, reason: str) -> None:
    with contextlib.suppress(Exception):
        await ops.cancel(svc, tenant, request_id)
        log.info(f"{reason}: request cancelled", request_id=request_id)


async def embeddings(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    state: dict[str, oa.Translated] = {}

    async def work() -> ApiResponse:
        tr = state["tr"] = _translate(svc, req, oa.translate_embeddings)
        answer = await _submit(svc, req, tr, Task.EMBED)
        view = await _result(svc, req, answer)
        error = oa.result_error(view)
        if error is not None:
            raise error
        return ApiResponse(200, oa.embedding_response(tr, view), {"X-Request-Id": str(view["id"])})

    return await _answer(work, lambda: state["tr"].aliases if "tr" in state else {})


async def retrieve_model(svc: GatewayService, req: ApiRequest, model: str) -> ApiResponse:
    async def work() -> ApiResponse:
        spec = svc.settings.model(model)
        if spec is None:
            raise oa.OpenAIError(404, f"the model {model!r} does not exist", code="model_not_found", param="model")
        return ApiResponse(200, _entry(svc, spec))

    return await _answer(work)


def _entry(svc: GatewayService, spec: ModelSpec) -> dict[str, Any]:
    """A model as OpenAI lists it, with vLLM's `max_model_len` where the model's context is known here: the longest
    sequence a request can reach, its context or less where the model file's limits on a prompt and on its new
    tokens add up to less (a vLLM client sizes a prompt as `max_model_len - max_tokens`: tiny-llama's context of
    4,096 had it send prompts past the 2,048 a prompt may hold)."""
    limits = ops.effective_limits(svc, spec)
    context = limits.get("context_length")
    return oa.model_entry(spec.name, max_model_len=None if context is None else min(
        context, limits["max_input_tokens"] + limits["max_new_tokens"]))


def list_data(svc: GatewayService) -> list[dict[str, Any]]:
    """`data` of `GET /v1/models` in OpenAI's shape (`handlers.list_models` adds it to its answer)."""
    return [_entry(svc, spec) for spec in svc.settings.models]
