"""The Batch API's routes, as OpenAI defines them: `POST /v1/batches`, `GET /v1/batches` (newest first,
`after` and `limit`), `GET /v1/batches/{batch_id}`, `POST /v1/batches/{batch_id}/cancel`.

Creating a batch records it (`validating`) and answers at once; a batch runner (`gateway.batch_runner`)
validates its file, runs it and writes its files. A batch belongs to the tenant that created it (another
tenant's id is a 404). Errors are in OpenAI's shape, as on the other OpenAI routes.
"""

from __future__ import annotations

from typing import Any

from gateway.api import ApiRequest, ApiResponse
from gateway.openai_api import answer_openai
from gateway.parsing import parse_body
from gateway.service import GatewayService
from shared import files
from shared import openai_shapes as oa
from shared.batch_store import BatchState, BatchStore
from shared.batches import (
    NATIVE_ENDPOINT,
    BatchError,
    BatchMeta,
    batch_object,
    check_endpoint,
    check_metadata,
    new_batch_id,
    window_seconds,
)
from shared.ssrf import RefusedURL, check_url, normalized_url

CREATE_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "callback_url"}
LIST_LIMIT = 100


def _store(svc: GatewayService) -> BatchStore:
    return BatchStore(svc.redis, svc.keys)


def _invalid(err: BatchError) -> oa.OpenAIError:
    return oa.invalid(err.param, err.message, err.code)


async def _visible(svc: GatewayService, tenant: str, batch_id: str) -> BatchState:
    st = await _store(svc).get(batch_id) if batch_id.startswith("batch_") and len(batch_id) < 64 else None
    if st is None or st.meta.tenant != tenant:
        raise oa.OpenAIError(404, f"no batch {batch_id!r}", code="batch_not_found", param="batch_id")
    return st


def _endpoint(svc: GatewayService, value: object) -> str:
    """The batch's endpoint; a native one's model must be known now (no need to read the file to refuse it)."""
    endpoint = check_endpoint(value)
    native = NATIVE_ENDPOINT.match(endpoint)
    if native and svc.settings.model(native.group(1)) is None:
        raise BatchError(f"unknown model {native.group(1)!r}", code="model_not_found", param="endpoint")
    return endpoint


async def _callback_url(svc: GatewayService, tenant: str, value: Any) -> str | None:
    """The batch's `callback_url`, normalized, checked as a request's callback is (SSRF guard, disabled by a 410)."""
    if value is None:
        return None
    try:
        check_url(value if isinstance(value, str) else "", svc.callback_allow)
    except RefusedURL as exc:
        raise oa.invalid("callback_url", str(exc)) from None
    url = normalized_url(value)
    if await svc.callbacks.is_disabled(tenant, url):  # as a request naming it is refused
        raise oa.invalid("callback_url", "this URL answered 410 Gone and is disabled for this tenant "
                         "(`batchgate webhooks enable URL --tenant T` allows it again)", "callback_disabled")
    return url


async def create_batch(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    async def work() -> ApiResponse:
        body = parse_body(req, svc.settings.max_body_bytes)
        if not isinstance(body, dict):
            raise oa.invalid(None, "the body must be a JSON object")
        if "output_expires_after" in body:  # a parameter of OpenAI's, for a policy this gateway does not have
            raise oa.invalid("output_expires_after", "not supported: a batch's output and error files are kept "
                                                     "until they are deleted (DELETE /v1/files/{file_id})",
                             "unsupported_parameter")
        unknown = sorted(set(body) - CREATE_FIELDS)
        if unknown:
            raise oa.invalid(unknown[0], f"unknown parameter {unknown[0]!r}", "unknown_parameter")
        try:
            endpoint = _endpoint(svc, body.get("endpoint"))
            window = window_seconds(body.get("completion_window"))
            metadata = check_metadata(body.get("metadata"))
        except BatchError as err:
            raise _invalid(err) from None
        callback = await _callback_url(svc, req.tenant, body.get("callback_url"))
        file_id = body.get("input_file_id")
        if file_id is None:
            raise oa.invalid("input_file_id", "required: the id of a file uploaded with purpose 'batch'",
                             "missing_required_parameter")
        if not isinstance(file_id, str):
            raise oa.invalid("input_file_id", f"must be a string (a file id), not {type(file_id).__name__}")
        fmeta = await files.get_meta(svc.redis, svc.keys, file_id)
        if fmeta is None or fmeta.tenant != req.tenant:
            raise oa.OpenAIError(404, f"no file {file_id!r}", code="file_not_found", param="input_file_id")
        if fmeta.purpose != "batch":
            raise oa.invalid("input_file_id", f"file {file_id} has purpose {fmeta.purpose!r}; a batch's input file "
                             "needs purpose 'batch'")
        now = svc.clock()
        meta = BatchMeta(id=new_batch_id(int(now * 1000)), tenant=req.tenant, endpoint=endpoint, input_file_id=file_id,
                         completion_window=str(body["completion_window"]), created_at=int(now),
                         expires_at=int(now + window), metadata=metadata, callback_url=callback)
        await _store(svc).create(meta)
        st = await _store(svc).get(meta.id)
        assert st is not None
        return ApiResponse(200, batch_object(st.meta, st.progress))

    return await answer_openai(work)


async def get_batch(svc: GatewayService, req: ApiRequest, batch_id: str) -> ApiResponse:
    async def work() -> ApiResponse:
        st = await _visible(svc, req.tenant, batch_id)
        return ApiResponse(200, batch_object(st.meta, st.progress))

    return await answer_openai(work)


async def list_batches(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    async def work() -> ApiResponse:
        raw_limit = req.query.get("limit", "20")
        if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= LIST_LIMIT:
            raise oa.invalid("limit", f"limit must be an integer from 1 to {LIST_LIMIT}")
        limit, after = int(raw_limit), req.query.get("after")
        ids = await _store(svc).ids(req.tenant)
        if after:
            if after not in ids:
                raise oa.invalid("after", f"no batch {after!r} to list after")
            ids = ids[ids.index(after) + 1:]
        data: list[dict[str, Any]] = []
        for batch_id in ids[:limit]:
            st = await _store(svc).get(batch_id)
            if st is not None:
                data.append(batch_object(st.meta, st.progress))
        return ApiResponse(200, {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit})

    return await answer_openai(work)


async def cancel_batch(svc: GatewayService, req: ApiRequest, batch_id: str) -> ApiResponse:
    """Stop feeding; the runner cancels the items in flight that have not started, lets those running finish, and
    finalizes (`cancelled`)."""
    async def work() -> ApiResponse:
        await _visible(svc, req.tenant, batch_id)
        status = await _store(svc).move(batch_id, "cancelling", "cancelling_at", int(svc.clock()),
                                        from_=("validating", "in_progress"))
        if status != "cancelling":  # a second cancel while cancelling is the same cancel; once ended, 409
            raise oa.OpenAIError(409, f"the batch is {status}: nothing to cancel", code="batch_not_cancellable",
                                 retry=False)
        st = await _visible(svc, req.tenant, batch_id)
        return ApiResponse(200, batch_object(st.meta, st.progress))

    return await answer_openai(work)
