"""OpenAI's Files API, for the Batch API's input files (docs/batches.md, "Files"):
`POST /v1/files` (multipart/form-data: `file`, `purpose`), `GET /v1/files`, `GET /v1/files/{file_id}`,
`GET /v1/files/{file_id}/content` and `DELETE /v1/files/{file_id}`.

An upload is streamed: its multipart body is parsed as it arrives (`gateway.multipart`), the file part
checked line by line (`shared.jsonl`) and written to the file store (`shared.files`) chunk by chunk, so the
gateway never holds a file whole. A file that breaks a rule is refused and nothing of it is kept. Files belong
to the tenant that uploaded them: another tenant's id is a 404. Errors are in OpenAI's shape (the routes'
`errors`, set in `gateway.routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import structlog

from gateway.api import (
    ApiError,
    ApiRequest,
    ApiResponse,
    BadRequest,
    Conflict,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    one_chunk,
)
from gateway.multipart import MultipartReader, Part
from gateway.service import GatewayService
from shared.batch_store import BatchStore
from shared.files import (
    PURPOSES,
    FileMeta,
    FileStore,
    delete_meta,
    file_store,
    get_meta,
    is_file_id,
    list_meta,
    new_file_id,
    put_meta,
)
from shared.jsonl import LineCheck

log = structlog.get_logger(__name__)

MAX_LIST = 10_000  # OpenAI's limit on `limit` (and its default)
MULTIPART_SLACK = 64 << 10  # what a multipart body may add to its file: boundaries, part headers, purpose
MAX_FILENAME = 255
UPLOADED = "batch"  # the one purpose callers upload with; "batch_output" files are batchgate's own


def _invalid(param: str, message: str, code: str = "invalid_request") -> BadRequest:
    return BadRequest(f"{param}: {message}", code=code, extra={"field": param})


def file_object(meta: FileMeta) -> dict[str, Any]:
    """A file as OpenAI's `FileObject`."""
    return {"id": meta.id, "object": "file", "bytes": meta.bytes, "created_at": meta.created_at,
            "filename": meta.filename, "purpose": meta.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def _store_failed(exc: Exception) -> ServiceUnavailable:
    log.warning("file store failed", error=repr(exc))
    return ServiceUnavailable("the file store failed; retry shortly", code="file_store_unavailable", retry_after=1)


async def _discard(store: FileStore, key: str) -> None:
    """Delete what an upload stored, even while the upload is being cancelled."""
    try:
        await asyncio.shield(store.delete(key))
    except Exception as exc:
        log.warning("could not delete a refused upload", key=key, error=repr(exc))


def _purpose(value: str) -> str:
    if value == UPLOADED:
        return value
    if value in PURPOSES:
        raise _invalid("purpose", f"{value!r} files are made by batchgate (a batch's output), not uploaded")
    raise _invalid("purpose", f"{value[:64]!r} is not supported: batchgate stores files for the Batch API, "
                              f"upload them with purpose {UPLOADED!r}")


class _Upload:
    """What an upload has delivered so far."""

    def __init__(self) -> None:
        self.purpose: str | None = None
        self.file_id: str | None = None
        self.filename = ""
        self.size = 0
        self.lines = 0


async def _write(svc: GatewayService, store: FileStore, part: Part, upload: _Upload) -> None:
    filename = part.filename if part.filename is not None else "file"
    if not filename or len(filename) > MAX_FILENAME:
        raise _invalid("file", f"the file name must have 1 to {MAX_FILENAME} characters")
    s = svc.settings
    check = LineCheck(max_bytes=s.max_file_bytes, max_lines=s.max_file_lines, max_line_bytes=s.max_body_bytes)
    file_id = new_file_id(svc.now_ms())
    try:
        upload.size = await store.write(file_id, check.check(part.chunks()))
    except ApiError:  # the file or the body broke a rule (or the body stalled): the store kept nothing
        raise
    except Exception as exc:
        raise _store_failed(exc) from exc
    upload.file_id, upload.filename, upload.lines = file_id, filename, check.lines


async def _read_parts(svc: GatewayService, store: FileStore, reader: MultipartReader, upload: _Upload) -> None:
    async for part in reader.parts():
        if part.name == "purpose":
            if upload.purpose is not None:
                raise _invalid("purpose", "sent more than once")
            upload.purpose = _purpose(await part.text(limit=64))
        elif part.name == "file":
            if upload.file_id is not None:
                raise _invalid("file", "send one file per upload")
            await _write(svc, store, part, upload)
        elif part.name.startswith("expires_after"):
            raise _invalid(part.name, "not supported: files are kept until they are deleted",
                           code="unsupported_parameter")
        else:
            raise _invalid(part.name[:64], "unknown form field (send file and purpose)")
    if upload.file_id is None:
        raise _invalid("file", "missing: send the file as the form field `file`")
    if upload.purpose is None:
        raise _invalid("purpose", f"missing: send purpose={UPLOADED}")


async def create_file(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    limit = svc.settings.max_file_bytes + MULTIPART_SLACK
    declared = req.header("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; a file may have {svc.settings.max_file_bytes}",
                              code="file_too_large")
    reader = MultipartReader(req.header("content-type"), req.stream if req.stream is not None else one_chunk(req.body))
    store = file_store(svc.settings)
    upload = _Upload()
    try:
        await _read_parts(svc, store, reader, upload)
        assert upload.file_id is not None and upload.purpose is not None
        meta = FileMeta(id=upload.file_id, tenant=req.tenant, bytes=upload.size, lines=upload.lines,
                        created_at=int(svc.clock()), filename=upload.filename, purpose=upload.purpose,
                        key=upload.file_id)
        await put_meta(svc.redis, svc.keys, meta)
    except BaseException:
        if upload.file_id is not None:
            await _discard(store, upload.file_id)
        raise
    log.info("file uploaded", file_id=meta.id, tenant=meta.tenant, bytes=meta.bytes, lines=meta.lines)
    return ApiResponse(200, file_object(meta))


def _query_int(req: ApiRequest, name: str, default: int, low: int, high: int) -> int:
    raw = req.query.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"-?[0-9]+", raw):  # int() takes "+5", " 5", "5_0" and other scripts' digits too
        raise _invalid(name, f"must be an integer, got {raw[:32]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise _invalid(name, f"must be between {low} and {high}, got {value}")
    return value


async def list_files(svc: GatewayService, req: ApiRequest) -> ApiResponse:
    limit = _query_int(req, "limit", MAX_LIST, 1, MAX_LIST)
    order = req.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _invalid("order", f"must be asc or desc, got {order[:32]!r}")
    after = req.query.get("after")
    if after is not None and not is_file_id(after):
        raise _invalid("after", f"must be a file id (file-...), got {after[:64]!r}")
    purpose = req.query.get("purpose") or None
    metas: list[FileMeta] = []
    more = False
    if purpose is None or purpose in PURPOSES:  # any other purpose: no file has it
        metas, more = await list_meta(svc.redis, svc.keys, req.tenant, purpose=purpose, after=after, limit=limit,
                                      order="asc" if order == "asc" else "desc")
    data = [file_object(m) for m in metas]
    return ApiResponse(200, {"object": "list", "data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})


async def _own(svc: GatewayService, req: ApiRequest, file_id: str) -> FileMeta:
    meta = await get_meta(svc.redis, svc.keys, file_id, tenant=req.tenant)
    if meta is None:
        raise NotFound(f"no such file: {file_id[:64]}", code="file_not_found", extra={"field": "file_id"})
    return meta


async def retrieve_file(svc: GatewayService, req: ApiRequest, file_id: str) -> ApiResponse:
    return ApiResponse(200, file_object(await _own(svc, req, file_id)))


async def delete_file(svc: GatewayService, req: ApiRequest, file_id: str) -> ApiResponse:
    meta = await _own(svc, req, file_id)
    store = BatchStore(svc.redis, svc.keys)
    for batch_id in await store.active():  # a running batch still reads its input file
        st = await store.get(batch_id)
        if st is not None and st.meta.input_file_id == meta.id:
            raise Conflict(f"file {file_id} is the input of batch {batch_id}, which has not finished; cancel it "
                           "first", code="file_in_use")
    await delete_meta(svc.redis, svc.keys, meta)  # gone for callers from here on
    try:
        await file_store(svc.settings).delete(meta.key)
    except Exception as exc:  # its bytes are unreachable now; only the store's space is lost
        log.warning("file deleted but its bytes were not", file_id=meta.id, key=meta.key, error=repr(exc))
    return ApiResponse(200, {"id": meta.id, "object": "file", "deleted": True})


async def file_content(svc: GatewayService, req: ApiRequest, file_id: str) -> ApiResponse:
    """The file's bytes as they are stored, streamed from the store (its first chunk is read here, so a store
    that fails answers with an error, not with a broken body)."""
    meta = await _own(svc, req, file_id)
    chunks = file_store(svc.settings).read(meta.key)
    try:
        first = await anext(chunks, b"")
    except FileNotFoundError:
        raise NotFound(f"the content of {file_id} is gone from the file store", code="file_not_found") from None
    except Exception as exc:
        raise _store_failed(exc) from exc
    return ApiResponse(200, stream=_then(first, chunks), media_type="application/octet-stream",
                       headers={"Content-Length": str(meta.bytes)})


async def _then(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        with contextlib.suppress(Exception):
            await rest.aclose()  # type: ignore[attr-defined]
