"""What a caller can do with requests, over a `QueueClient`: submit (with its idempotency key and an
optional wait), submit a batch, get (with an optional long-poll), cancel.

The HTTP gateway's handlers parse HTTP and call these; the SDK's direct mode calls them itself, so both
give the same statuses, bodies and errors (`shared.api_errors`). An `Answer` is a status and a JSON-ready
body (`shared.views` types), plus the headers the API sends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from shared.admission import Decision
from shared.api_errors import ApiError, BadRequest, Conflict, Gone, NotFound, TooManyRequests, Unprocessable
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.idempotency import IdempotencyClaim, body_hash
from shared.idempotency_keys import KEY_RULE, MAX_KEY_CHARS, derived_key, valid_idempotency_key
from shared.ids import created_ms, is_request_id
from shared.logs import get_logger
from shared.messages import ErrorInfo, InferenceRequest, RequestResult
from shared.params import finite_number
from shared.queue_client import QueueClient, Submitted
from shared.records import StoredRecord
from shared.redis_io import UNAVAILABLE, NotReplicated
from shared.states import FinishReason, Status, Task
from shared.submit import build_request
from shared.views import Accepted, links, record_view
from shared.waiters import SubscriptionUnavailable

log = get_logger(__name__)

IDEMPOTENCY_TAKEOVER_S = 5.0  # a key claimed this long ago without a stored request is taken over
IDEMPOTENCY_RACE_POLLS = 20
IDEMPOTENCY_RACE_POLL_S = 0.025
NO_ESTIMATE = "no worker has reported load recently: accepted without an estimate (up to the lane's backlog cap)"


@dataclass(slots=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def wait_seconds(value: float, cap: float) -> float:
    """How long a caller may wait for a result: a non-negative number of seconds, at most `cap`."""
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if finite_number(value) is None:
        raise BadRequest(f"wait must be a finite number of seconds, got {shown}", code="invalid_wait")
    if value < 0:
        raise BadRequest(f"wait must be a non-negative number of seconds, got {shown}", code="invalid_wait")
    return min(float(value), cap)


def check_idempotency_key(key: str) -> str:
    if not valid_idempotency_key(key):
        raise BadRequest(KEY_RULE, code="invalid_idempotency_key")
    return key


def model_spec(q: QueueClient, name: str) -> ModelSpec:
    spec = q.settings.model(name)
    if spec is None:
        known = ", ".join(m.name for m in q.settings.models)
        raise NotFound(f"unknown model {name!r} (known: {known})", code="model_not_found")
    return spec


def effective_limits(q: QueueClient, spec: ModelSpec) -> dict[str, Any]:
    """What a request to `spec` can hold, as submit holds it: the model file's limits within the model's own (an
    encoder's positions; a generation model's context, `context_length`, which a prompt and its new tokens share
    and a prompt alone must leave room in). None: the context is not known here (the worker still holds it)."""
    if spec.task is Task.EMBED:
        return {"max_input_tokens": q.token_limits.max_text_tokens(spec)}
    context = None if spec.echo else q.token_limits.context(spec)
    if context is None:
        return {"context_length": None}
    room = max(1, context - 1)
    return {"max_input_tokens": min(spec.max_input_tokens, room), "max_new_tokens": min(spec.max_new_tokens, room),
            "context_length": context}


def _build(q: QueueClient, body: Any, spec: ModelSpec, tenant: str, at: str = "") -> InferenceRequest:
    """The request a body asks for; a 422 naming the field otherwise (`at`: where the body sits in a batch)."""
    try:
        return build_request(body, spec, tenant, q.clock(), q.callback_allow, q.token_limits)
    except ValidationError as exc:
        where = f"{at}.{exc.field}" if at and exc.field else (at or exc.field)
        raise Unprocessable(f"{exc.field}: {exc.message}" if exc.field else exc.message,
                            code=exc.code or None, extra={"field": where}) from exc


async def submit(q: QueueClient, body: Any, spec: ModelSpec, tenant: str, *, wait: float = 0.0,
                 idempotency_key: str | None = None, rate_tokens: int = 1, call: str = "") -> Answer:
    """`rate_tokens`: what the request takes of its tenant's rate (a call of several requests takes them all with
    its first, 0 with the others). `call`: what the call says beyond the body that a retry with the same
    Idempotency-Key must say too (`body_hash`)."""
    inference = _build(q, body, spec, tenant)
    digest = ""
    if idempotency_key is not None:
        inference = dataclasses.replace(inference, idempotency_key=idempotency_key)
        digest = body_hash(spec.name, body, call)
        existing = await q.idempotency.get(tenant, idempotency_key)
        if existing is not None:
            return await _replay(q, existing, digest, inference, wait)
    await _refuse_disabled_callback(q, inference)  # a replay above is the original request, as it is now
    decision, inference = await _admit(q, inference, spec, rate_tokens)
    claim, existing = await _claim_key(q, inference, digest)
    if existing is not None:  # a concurrent submit with the same key won the race
        return await _replay(q, existing, digest, inference, wait)
    return await _store_and_answer(q, inference, decision, wait, claim=claim)


async def _refuse_disabled_callback(q: QueueClient, inference: InferenceRequest, at: str = "") -> None:
    """A new request naming a callback URL that answered 410 Gone for this tenant is refused (docs/webhooks.md)."""
    if inference.callback and await q.callbacks.is_disabled(inference.tenant, inference.callback.url):
        raise Unprocessable(f"{at}callback.url: this URL answered 410 Gone and is disabled for this tenant",
                            extra={"field": f"{at}callback.url"})


async def _claim_key(q: QueueClient, inference: InferenceRequest,
                     digest: str) -> tuple[IdempotencyClaim | None, IdempotencyClaim | None]:
    """After admission, claim the request's idempotency key: (our claim, None), or (None, the claim that won
    a race for it) with the quota slot given back; (None, None) without a key. If claiming fails, what
    admission took is given back before the error goes on."""
    if inference.idempotency_key is None:
        return None, None
    claim = IdempotencyClaim(inference.id, digest, q.now_ms())
    try:
        existing = await q.idempotency.claim(inference.tenant, inference.idempotency_key, claim)
    except BaseException as exc:
        await _unwind(q, inference, None, exc)
        raise
    if existing is not None:
        await q.limits.release(inference.tenant, inference.id)
        return None, existing
    return claim, None


async def _unwind(q: QueueClient, inference: InferenceRequest, claim: IdempotencyClaim | None,
                  exc: BaseException) -> None:
    """A step after admission failed: give back what admission took, so nothing leaks until the deadline.

    The tenant's quota slot where it took one (were the request stored after all, its worker removes it anyway);
    where Redis may be gone, the caller's answer waits for that a moment only, the release going on behind it.
    The idempotency key unless the store may have reached Redis (a connection lost mid-pipeline, a
    cancellation): then the key is kept, and a retry after `IDEMPOTENCY_TAKEOVER_S` takes the claim over
    under the same id, so the key never maps to two requests."""
    if isinstance(exc, NotReplicated):  # stored on the master, the caller told 503: no worker may compute it
        await _withdraw(q, inference)
    maybe_stored = isinstance(exc, (*UNAVAILABLE, asyncio.CancelledError)) and not isinstance(exc, NotReplicated)
    log.warning("submit failed after admission; releasing what it took", request_id=inference.id,
                error=repr(exc), key_kept=bool(claim and maybe_stored))
    if inference.quota_slot:
        task = asyncio.get_running_loop().create_task(_release_slot(q, inference))
        _releasing.add(task)
        task.add_done_callback(_releasing.discard)
        # where Redis may be gone, the caller's 503 must not wait a second socket timeout on it: the release goes
        # on in the background past a moment (a Redis that answers has answered by then)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), RELEASE_WAIT_S if maybe_stored else None)
    if claim is not None and inference.idempotency_key and not maybe_stored:
        with contextlib.suppress(Exception):
            await q.idempotency.release(inference.tenant, inference.idempotency_key, claim)


async def _withdraw(q: QueueClient, inference: InferenceRequest) -> None:
    """A request stored on the master that its replicas did not confirm in time (durable writes): its caller is
    answered 503, so it ends here, cancelled, before a worker computes it (a worker skips a request that has
    ended), and a retry, with its idempotency key or without, makes one request, not two; its webhook, if it named
    one, is never sent (it was never accepted). The end is written on the master as the store was; its own
    confirmation is not waited for (the caller is answered already)."""
    meta = dataclasses.replace(inference.meta(), callback=None)  # its webhook too: for a request never accepted
    with contextlib.suppress(Exception):
        await q.store.finish_all([(RequestResult(
            id=inference.id, status=Status.CANCELLED, finish_reason=FinishReason.CANCELLED,
            error=ErrorInfo("not_replicated", "the submit was answered 503: its write was not confirmed by the "
                                              "replicas BATCHGATE_REDIS_WAIT_REPLICAS asks for"),
            finished_ms=q.now_ms(), worker="gateway"), meta)], durable=False)


_releasing: set[asyncio.Task[None]] = set()  # quota slots being given back (see `_unwind`)
RELEASE_WAIT_S = 0.5  # how long a failed submit waits for its slot's release where Redis may be gone


async def _release_slot(q: QueueClient, inference: InferenceRequest) -> None:
    with contextlib.suppress(Exception):
        await q.limits.release(inference.tenant, inference.id)


async def _admit(q: QueueClient, inference: InferenceRequest, spec: ModelSpec,
                 rate_tokens: int = 1) -> tuple[Decision, InferenceRequest]:
    """Tenant limits (rate, quota slot) then the deadline/backlog estimate; a refusal frees the slot. The request
    comes back marked with whether it holds a quota slot."""
    expires = inference.deadline_ms + int(q.settings.expiry_grace_s * 1000)
    if not await q.limits.admit(inference.tenant, inference.id, expires, tokens=rate_tokens):
        inference = dataclasses.replace(inference, quota_slot=False)
    try:
        decision, _ = await q.admit(inference, spec)
    except BaseException as exc:
        await _unwind(q, inference, None, exc)
        raise
    if not decision.accept:
        await q.limits.release(inference.tenant, inference.id)
        q.observer.rejected(inference, decision.code)
        # a refusal no retry can change says so (OpenAI's clients read `x-should-retry` and do not resubmit)
        raise TooManyRequests(decision.reason, code=decision.code, retry_after=decision.retry_after_s,
                              extra={"lane": inference.lane},
                              headers=None if decision.retryable else {"x-should-retry": "false"})
    return decision, inference


def _eta_ms(decision: Decision) -> int | None:
    est = decision.estimate
    return round(est.finish_s * 1000) if est.basis == "stats" else None


async def submit_batch(q: QueueClient, body: Any, spec: ModelSpec, tenant: str,
                       idempotency_key: str | None = None) -> Answer:
    """Many inputs in one call (e.g. an SQS batch): one id per accepted item, an error per refused one.

    Body: {"requests": [<submit body>, ...]}; an item may carry `idempotency_key` (an SQS message id,
    say) so a redelivered batch does not create its accepted items twice. `idempotency_key` (the call's
    `Idempotency-Key` header) keys each item that carries none with `derived_key(key, index)`: the same call sent again
    answers with the same requests."""
    items = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise Unprocessable("requests: a non-empty list of submit bodies (objects) is required",
                            extra={"field": "requests"})
    if (i := next((i for i, item in enumerate(items) if not isinstance(item, dict)), None)) is not None:
        got = "null" if items[i] is None else type(items[i]).__name__
        raise Unprocessable(f"requests[{i}]: a submit body (an object) is required, not {got}",
                            extra={"field": f"requests[{i}]"})
    if set(body) - {"requests"}:
        name = sorted(set(body) - {"requests"})[0]
        raise Unprocessable(f"{name}: unknown field (allowed: requests)", extra={"field": name})
    if len(items) > q.settings.max_batch_items:
        raise Unprocessable(f"requests: at most {q.settings.max_batch_items} items per batch",
                            extra={"field": "requests"})
    results: list[dict[str, Any]] = []
    to_store: list[_Pending] = []
    try:
        for i, item in enumerate(items):
            try:
                results.append(await _batch_item(q, spec, tenant, i, item, to_store,
                                                 None if idempotency_key is None else derived_key(idempotency_key, i)))
            except ApiError as exc:
                err: dict[str, Any] = {"code": exc.code, "message": exc.message, **exc.extra}
                if exc.retry_after is not None:
                    err["retry_after"] = exc.retry_after
                results.append({"index": i, "status": exc.status, "error": err})
        stored = await q.submit_many([(p.inference, p.decision) for p in to_store]) if to_store else []
    except BaseException as exc:  # nothing of this batch was stored (or may have been: see `_unwind`)
        for p in to_store:
            await _unwind(q, p.inference, p.claim, exc)
        raise
    for p, sub in zip(to_store, stored, strict=True):
        q.observer.submitted(p.inference)
        results[p.index] = {"index": p.index, "status": 202, "id": p.inference.id, "lane": p.inference.lane,
                            "queue_position": sub.queue_position, "eta_ms": _eta_ms(sub.decision),
                            "links": links(p.inference.id)}
    accepted = sum(1 for r in results if r["status"] in (200, 202))
    replayed = sum(1 for r in results if r.get("replayed"))  # of the accepted: an existing request's id, none new
    return Answer(200, {"results": results, "accepted": accepted, "replayed": replayed,
                        "refused": len(results) - accepted})


@dataclass(slots=True)
class _Pending:
    """A batch item admitted (and its key claimed) but not stored yet."""

    index: int
    inference: InferenceRequest
    decision: Decision
    digest: str
    claim: IdempotencyClaim | None


async def _batch_item(q: QueueClient, spec: ModelSpec, tenant: str, i: int, item: Any,
                      to_store: list[_Pending], call_key: str | None = None) -> dict[str, Any]:
    """`call_key`: the item's key from the call's `Idempotency-Key`, unless it carries its own."""
    key = item.get("idempotency_key")
    body = {k: v for k, v in item.items() if k != "idempotency_key"}
    if key is not None and (not isinstance(key, str) or not valid_idempotency_key(key)):
        raise Unprocessable(f"idempotency_key must be a string of 1-{MAX_KEY_CHARS} printable ASCII characters, "
                            "no comma (the rule of the Idempotency-Key header)",
                            extra={"field": f"requests[{i}].idempotency_key"})
    key = call_key if key is None else key
    try:
        inference = _build(q, body, spec, tenant, at=f"requests[{i}]")
    except Unprocessable as exc:
        raise _with_item_fields(exc, f"requests[{i}].") from exc
    digest = body_hash(spec.name, body)
    if key is not None:
        inference = dataclasses.replace(inference, idempotency_key=key)
        earlier = next((p for p in to_store if p.inference.idempotency_key == key), None)
        if earlier is not None:  # the same key earlier in this batch: the same request, not a second one
            if earlier.digest != digest:
                raise Conflict(f"requests[{i}].idempotency_key: used by requests[{earlier.index}] of this batch "
                               "with a different body", code="idempotency_conflict",
                               extra={"field": f"requests[{i}].idempotency_key"})
            return {"index": i, "status": 202, "id": earlier.inference.id, "replayed": True,
                    "request_status": "queued", "links": links(earlier.inference.id)}  # stored by this call
        existing = await q.idempotency.get(tenant, key)
        if existing is not None:
            return await _batch_replay(q, i, existing, digest, inference)
    await _refuse_disabled_callback(q, inference, f"requests[{i}].")
    decision, inference = await _admit(q, inference, spec)
    claim, existing = await _claim_key(q, inference, digest)
    if existing is not None:
        return await _batch_replay(q, i, existing, digest, inference)
    to_store.append(_Pending(i, inference, decision, digest, claim))
    return {"index": i, "status": 0}  # filled in once stored


def _with_item_fields(exc: Unprocessable, at: str) -> Unprocessable:
    """An unknown top-level field of a batch item: its allowed fields include the item's own
    `idempotency_key`, which is read before the body is."""
    field = str(exc.extra.get("field", "")).removeprefix(at)
    head, sep, names = exc.message.partition("unknown field (allowed: ")
    if not sep or not field or any(c in field for c in ".["):
        return exc
    allowed = sorted({*names.rstrip(")").split(", "), "idempotency_key"})
    return Unprocessable(f"{head}unknown field (allowed: {', '.join(allowed)})", extra=exc.extra)


async def _batch_replay(q: QueueClient, i: int, existing: IdempotencyClaim, digest: str,
                        inference: InferenceRequest) -> dict[str, Any]:
    """A batch item whose key was seen: the original request, never a second one (as `_replay`)."""
    if existing.body_hash != digest:  # named as the item's key, as a conflict within the batch is
        raise Conflict(f"requests[{i}].idempotency_key: used with a different body by request {existing.request_id}",
                       code="idempotency_conflict", extra={"field": f"requests[{i}].idempotency_key"})
    answer = await _replay(q, existing, digest, inference, wait=0.0)
    return {"index": i, "status": answer.status, "id": existing.request_id, "replayed": True,
            "request_status": answer.body.get("status"), "links": links(existing.request_id)}


async def _store(q: QueueClient, inference: InferenceRequest, decision: Decision,
                 claim: IdempotencyClaim | None) -> Submitted:
    try:
        submitted = await q.submit(inference, decision)
    except BaseException as exc:
        await _unwind(q, inference, claim, exc)
        raise
    q.observer.submitted(inference)
    log.info("request accepted", request_id=inference.id, model=inference.model, lane=inference.lane,
             priority=inference.priority.value, est_tokens=inference.est_tokens)
    return submitted


async def _store_and_answer(q: QueueClient, inference: InferenceRequest, decision: Decision, wait: float,
                            headers: dict[str, str] | None = None, *,
                            claim: IdempotencyClaim | None = None) -> Answer:
    headers = {"Location": links(inference.id)["self"], **(headers or {})}
    status: Literal["queued", "running"] = "queued"
    if wait > 0:
        # subscribed before the store: its result cannot come unseen, so the record is not read before waiting
        subscribing, submitted, rec = True, None, None
        try:
            async with q.waiting(inference.id) as sub:
                subscribing = False
                submitted = await _store(q, inference, decision, claim)  # gives back what it took if it fails
                stored = inference if submitted.created else None  # else: the record may be terminal already
                rec = await (q.wait_on(sub, inference.id, wait, stored=stored) if sub is not None
                             else q.get(inference.id))
        except BaseException as exc:
            if subscribing:  # nothing stored: give back what admission took
                await _unwind(q, inference, claim, exc)
            # stored, and then Redis went away while it waited: the request is accepted and runs, so its caller
            # is told so (202, its id), not "unavailable, retry" (a retry without a key would compute it twice)
            if submitted is None or not isinstance(exc, (*UNAVAILABLE, SubscriptionUnavailable)):
                raise
            log.warning("the wait for a stored request failed; answered 202", request_id=inference.id,
                        error=repr(exc))
        assert submitted is not None
        if rec is not None and rec.terminal:
            return Answer(200, record_view(rec), headers)
        if rec is not None and rec.state is Status.RUNNING:  # the wait ran out while it computes: say so
            status = "running"
    else:
        submitted = await _store(q, inference, decision, claim)
    accepted = Accepted(
        id=inference.id, status=status, model=inference.model, lane=inference.lane,
        eta_ms=_eta_ms(submitted.decision), queue_position=submitted.queue_position,
        deadline=inference.deadline_ms / 1000, links=links(inference.id),
        admission=UNSET if submitted.decision.estimate.basis == "stats" else NO_ESTIMATE)
    return Answer(202, msgspec.to_builtins(accepted), headers)


async def _replay(q: QueueClient, existing: IdempotencyClaim, digest: str, inference: InferenceRequest,
                  wait: float) -> Answer:
    """A submit whose idempotency key was seen before: the original request, never a second one."""
    if existing.body_hash != digest:
        raise Conflict("this Idempotency-Key was used with a different request body", code="idempotency_conflict")
    replayed = {"Idempotent-Replayed": "true", "Location": links(existing.request_id)["self"]}
    rec = await q.get(existing.request_id)
    for _ in range(IDEMPOTENCY_RACE_POLLS):  # the first submit is a few milliseconds ahead of us
        if rec is not None or q.now_ms() - existing.at_ms > IDEMPOTENCY_TAKEOVER_S * 1000:
            break
        await asyncio.sleep(IDEMPOTENCY_RACE_POLL_S)
        rec = await q.get(existing.request_id)
    if rec is None:
        if q.now_ms() - existing.at_ms <= IDEMPOTENCY_TAKEOVER_S * 1000:
            raise Conflict("a request with this Idempotency-Key is being accepted; retry shortly",
                           code="idempotency_in_progress", retry_after=1)
        # the first submit claimed the key and never stored its request (its gateway died): store it now,
        # under the same id, so the key still maps to exactly one request. Compare-and-set: of several
        # takeovers at once, one wins; the others answer as replays.
        takeover = dataclasses.replace(inference, id=existing.request_id)
        fresh = IdempotencyClaim(takeover.id, digest, q.now_ms())
        if not await q.idempotency.takeover(inference.tenant, inference.idempotency_key or "", existing, fresh):
            raise Conflict("a request with this Idempotency-Key is being accepted; retry shortly",
                           code="idempotency_in_progress", retry_after=1)
        decision, takeover = await _admit(q, takeover, model_spec(q, takeover.model))
        return await _store_and_answer(q, takeover, decision, wait, replayed)
    if wait > 0 and not rec.terminal:
        rec = await q.wait(rec.id, wait) or rec
    return Answer(200 if rec.terminal else 202, record_view(rec), replayed)


async def visible(q: QueueClient, tenant: str, request_id: str) -> StoredRecord:
    """The tenant's request: 404 for an unknown id or another tenant's, 410 for one whose result expired."""
    if not is_request_id(request_id):
        raise NotFound(f"no request {request_id!r}", code="request_not_found")
    rec = await q.get(request_id)
    if rec is None or (rec.meta is not None and rec.meta.tenant != tenant):
        born = created_ms(request_id) or 0
        ttl = q.settings.result_ttl_s
        if rec is None and q.now_ms() - born > ttl * 1000:
            raise Gone(f"request {request_id!r} is gone: results are kept for {ttl} s", code="result_expired")
        raise NotFound(f"no request {request_id!r}", code="request_not_found")
    return rec


async def get(q: QueueClient, tenant: str, request_id: str, *, wait: float = 0.0) -> Answer:
    rec = await visible(q, tenant, request_id)
    if wait > 0 and not rec.terminal:
        rec = await q.wait(request_id, wait) or rec
    return Answer(200, record_view(rec))


async def cancel(q: QueueClient, tenant: str, request_id: str) -> Answer:
    rec = await visible(q, tenant, request_id)
    if rec.terminal:  # cancelled included: there is nothing left to cancel (README: 409 once finished)
        raise Conflict(f"request already {rec.state.value}; nothing to cancel", code="already_finished")
    won = await q.cancel(rec)
    rec = await q.get(request_id) or rec
    if not won or rec.state is not Status.CANCELLED:  # a worker (or another cancel) finished it first
        raise Conflict(f"request already {rec.state.value}; nothing to cancel", code="already_finished")
    q.observer.cancelled(rec.meta.model if rec.meta else "unknown")
    return Answer(200, record_view(rec))
