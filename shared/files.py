"""Files (the Files API; the Batch API's input and output): where their bytes live and what is known of them.

The bytes sit behind one port, `FileStore`, with two adapters: `LocalFileStore` (a directory: the default,
so `batchgate up` needs no configuration) and `S3FileStore` (a bucket); `file_store(settings)` picks S3 when
`BATCHGATE_FILES_S3_BUCKET` is set. Every adapter keeps the same contract (tests/unit/test_files.py runs one
suite against both):
- `write(key, chunks)` consumes the chunks and returns the bytes written; it is atomic: the key is visible
  only once every chunk is stored, and a write that fails (the iterator raised, the caller was cancelled, the
  store failed) leaves nothing, and an earlier object under the key is then untouched;
- `read(key, start=0)` streams the bytes from a byte offset (the batch feeder resumes mid-file); a missing
  key raises FileNotFoundError when first iterated; a start at or past the end yields nothing;
- `delete(key)` is idempotent; `size(key)` is None for a missing key.
Neither adapter holds a file whole in memory: local writes go through a 1 MiB buffer, S3 writes through one
8 MiB part of a multipart upload; reads come in 64 KiB chunks.
Keys are simple names (`check_key`): batchgate uses the file's id.

What is known of a file is a `FileMeta` in Redis (`put_meta`, `get_meta`, `delete_meta`, `list_meta`), with
per-tenant indexes for listing (`Keys.file`, `Keys.files`). `save_file` does both for a file batchgate
makes itself (a batch's output): store the bytes, then record them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import msgspec
import redis.asyncio as aioredis

from shared.config import Settings, default_files_dir
from shared.keys import Keys

READ_CHUNK = 64 << 10
LOCAL_WRITE_BUFFER = 1 << 20
S3_PART_BYTES = 8 << 20  # S3's parts are at least 5 MiB (all but the last)

PURPOSES = ("batch", "batch_output")  # "batch": uploaded by callers; "batch_output": written by batchgate
_KEY_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}$")
_FILE_ID_RE = re.compile(r"^file-[a-z2-7]{26}$")
# base32's digits (a-z, then 2-7) do not sort as their values do; the listing indexes hold each id in
# base32hex (0-9, then a-v), which does: so an index in lexical order is in creation order
_TO_INDEX = str.maketrans("abcdefghijklmnopqrstuvwxyz234567", "0123456789abcdefghijklmnopqrstuv")
_FROM_INDEX = str.maketrans("0123456789abcdefghijklmnopqrstuv", "abcdefghijklmnopqrstuvwxyz234567")


def check_key(key: str) -> str:
    """A store key: letters, digits, '_', '-' and '.' (not first), at most 200: a plain file name anywhere."""
    if not _KEY_RE.match(key):
        raise ValueError(f"file store key {key!r}: use letters, digits, '_', '-' and '.' (not first)")
    return key


def _check_start(start: int) -> None:
    if start < 0:
        raise ValueError(f"read start must be >= 0, got {start}")


class FileStore(Protocol):
    async def write(self, key: str, chunks: AsyncIterator[bytes]) -> int: ...

    def read(self, key: str, start: int = 0) -> AsyncIterator[bytes]: ...

    async def delete(self, key: str) -> None: ...

    async def size(self, key: str) -> int | None: ...


# ------------------------------------------------------------------------------------------- local disk


class LocalFileStore:
    """Files in one directory (created on the first write). A write goes to a hidden temporary file in the
    same directory, is fsynced, then renamed over the key: readers see the whole file or none."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / check_key(key)

    async def write(self, key: str, chunks: AsyncIterator[bytes]) -> int:
        path = self._path(key)
        await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{secrets.token_hex(6)}.part"
        f: IO[bytes] = await asyncio.to_thread(open, tmp, "xb")
        size = 0
        try:
            buf = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                buf += chunk
                if len(buf) >= LOCAL_WRITE_BUFFER:
                    await asyncio.to_thread(f.write, bytes(buf))
                    buf.clear()
            await asyncio.to_thread(_commit, f, bytes(buf), tmp, path)
        except BaseException:
            f.close()  # quick local calls, made here: a cancelled write must not leave its temporary file
            tmp.unlink(missing_ok=True)
            raise
        return size

    async def read(self, key: str, start: int = 0) -> AsyncIterator[bytes]:
        _check_start(start)
        path = self._path(key)
        f: IO[bytes] = await asyncio.to_thread(open, path, "rb")
        try:
            if start:
                f.seek(start)
            while chunk := await asyncio.to_thread(f.read, READ_CHUNK):
                yield chunk
        finally:
            f.close()

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, missing_ok=True)

    async def size(self, key: str) -> int | None:
        try:
            return (await asyncio.to_thread(self._path(key).stat)).st_size
        except FileNotFoundError:
            return None


def _commit(f: IO[bytes], last: bytes, tmp: Path, path: Path) -> None:
    f.write(last)
    f.flush()
    os.fsync(f.fileno())
    f.close()
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------ S3


def s3_error_code(exc: Exception) -> str:
    """The code S3 answered a failed call with (a boto3 ClientError's), or ''."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


class S3FileStore:
    """Files as objects under `prefix` in `bucket`, through a boto3 S3 client (its calls run in threads).

    A write shorter than one part is one PutObject; a longer one a multipart upload, completed at the end
    (aborted when the write fails): either way the object appears whole or not at all. `start` is a ranged
    GET."""

    def __init__(self, bucket: str, prefix: str = "", client: Any = None) -> None:
        if client is None:
            import boto3  # the `aws` extra: only a deployment that names a bucket needs it

            client = boto3.client("s3")
        self.bucket, self.prefix, self.client = bucket, prefix, client

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    async def write(self, key: str, chunks: AsyncIterator[bytes]) -> int:
        name = self._name(key)
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        size = 0
        try:
            buf = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                buf += chunk
                if len(buf) >= S3_PART_BYTES:
                    if upload_id is None:
                        created = await asyncio.to_thread(self.client.create_multipart_upload,
                                                          Bucket=self.bucket, Key=name)
                        upload_id = str(created["UploadId"])
                    data = bytes(buf)
                    buf.clear()
                    parts.append(await self._part(name, upload_id, len(parts) + 1, data))
            if upload_id is None:
                await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=name, Body=bytes(buf))
                return size
            if buf:
                parts.append(await self._part(name, upload_id, len(parts) + 1, bytes(buf)))
            await asyncio.to_thread(self.client.complete_multipart_upload, Bucket=self.bucket, Key=name,
                                    UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            if upload_id is not None:  # its parts would be kept (and billed) until aborted
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.to_thread(self.client.abort_multipart_upload, Bucket=self.bucket,
                                                           Key=name, UploadId=upload_id))
            raise
        return size

    async def _part(self, name: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        out = await asyncio.to_thread(self.client.upload_part, Bucket=self.bucket, Key=name, UploadId=upload_id,
                                      PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": out["ETag"]}

    async def read(self, key: str, start: int = 0) -> AsyncIterator[bytes]:
        _check_start(start)
        name = self._name(key)
        ranged = {"Range": f"bytes={start}-"} if start else {}
        try:
            obj = await asyncio.to_thread(self.client.get_object, Bucket=self.bucket, Key=name, **ranged)
        except Exception as exc:
            code = s3_error_code(exc)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"s3://{self.bucket}/{name}") from exc
            if code == "InvalidRange" and await self.size(key) is not None:
                return  # the start is at or past the end
            raise
        body = obj["Body"]
        try:
            pieces = body.iter_chunks(READ_CHUNK)
            while chunk := await asyncio.to_thread(next, pieces, b""):
                yield chunk
        finally:
            body.close()

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self._name(key))

    async def size(self, key: str) -> int | None:
        try:
            head = await asyncio.to_thread(self.client.head_object, Bucket=self.bucket, Key=self._name(key))
        except Exception as exc:
            if s3_error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return int(head["ContentLength"])


@functools.cache
def _s3_store(bucket: str, prefix: str, endpoint: str) -> S3FileStore:
    import boto3

    return S3FileStore(bucket, prefix, boto3.client("s3", endpoint_url=endpoint or None))


def file_store(settings: Settings) -> FileStore:
    """The deployment's store: S3 when `BATCHGATE_FILES_S3_BUCKET` is set (one client per process), else
    the directory `BATCHGATE_FILES_DIR` (default `~/.local/share/batchgate/files`)."""
    if settings.files_s3_bucket:
        return _s3_store(settings.files_s3_bucket, settings.files_s3_prefix, settings.files_s3_endpoint)
    return LocalFileStore(settings.files_dir or default_files_dir({}))


# ------------------------------------------------------------------------------------------- metadata


class FileMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What is known of a stored file. `key` is where its bytes are in the store; `lines` counts its lines
    (the last one whether or not a newline ends it)."""

    id: str
    tenant: str
    bytes: int
    lines: int
    created_at: int  # Unix seconds
    filename: str
    purpose: str  # one of PURPOSES
    key: str


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(FileMeta)


def new_file_id(now_ms: int | None = None) -> str:
    """`file-` + base32 of a 48-bit millisecond time and 80 random bits (as request ids are): unguessable, and
    ordered by creation (the listing indexes rely on it)."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    raw = ms.to_bytes(6, "big") + secrets.token_bytes(10)
    return "file-" + base64.b32encode(raw).decode("ascii").rstrip("=").lower()


def is_file_id(value: str) -> bool:
    return bool(_FILE_ID_RE.match(value))


def _index_member(file_id: str) -> str:
    return file_id[5:].translate(_TO_INDEX)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _file_id(member: bytes | str) -> str:
    return "file-" + _text(member).translate(_FROM_INDEX)


def _decode(raw: bytes | str) -> FileMeta:
    return _DECODER.decode(raw.encode() if isinstance(raw, str) else raw)


async def put_meta(redis: aioredis.Redis, keys: Keys, meta: FileMeta) -> None:
    """Record a file (after its bytes are stored): its metadata and its place in the tenant's indexes."""
    pipe = redis.pipeline(transaction=True)
    pipe.set(keys.file(meta.id), _ENCODER.encode(meta))
    pipe.zadd(keys.files(meta.tenant), {_index_member(meta.id): 0})
    pipe.zadd(keys.files(meta.tenant, meta.purpose), {_index_member(meta.id): 0})
    await pipe.execute()


async def get_meta(redis: aioredis.Redis, keys: Keys, file_id: str, tenant: str | None = None) -> FileMeta | None:
    """A file's metadata; None when there is none, or (with `tenant`) when it is another tenant's."""
    if not is_file_id(file_id):
        return None
    raw = await redis.get(keys.file(file_id))
    if raw is None:
        return None
    meta = _decode(raw)
    return meta if tenant is None or meta.tenant == tenant else None


async def delete_meta(redis: aioredis.Redis, keys: Keys, meta: FileMeta) -> None:
    """Forget a file (its bytes are the store's to delete, after this)."""
    pipe = redis.pipeline(transaction=True)
    pipe.delete(keys.file(meta.id))
    pipe.zrem(keys.files(meta.tenant), _index_member(meta.id))
    pipe.zrem(keys.files(meta.tenant, meta.purpose), _index_member(meta.id))
    await pipe.execute()


async def list_meta(redis: aioredis.Redis, keys: Keys, tenant: str, *, purpose: str | None = None,
                    after: str | None = None, limit: int = 10_000,
                    order: Literal["asc", "desc"] = "desc") -> tuple[list[FileMeta], bool]:
    """A tenant's files (of one purpose, or all) in creation order, newest first with "desc", starting after
    the id `after` (a cursor: the last id of the previous page); and whether more follow."""
    index = keys.files(tenant, purpose)
    found: list[FileMeta] = []
    cursor = _index_member(after) if after else None
    while True:  # more than one round only when the index held ids whose files were deleted meanwhile
        want = limit - len(found) + 1
        if order == "asc":
            ids = await redis.zrangebylex(index, f"({cursor}" if cursor else "-", "+", start=0, num=want)
        else:
            ids = await redis.zrevrangebylex(index, f"({cursor}" if cursor else "+", "-", start=0, num=want)
        if not ids:
            return found, False
        pipe = redis.pipeline(transaction=False)  # not MGET: on a Redis Cluster the files are in many slots
        for i in ids:
            pipe.get(keys.file(_file_id(i)))
        raws = await pipe.execute()
        stale = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if stale:  # a file deleted between its two writes' worth of commands: drop it from the index
            await redis.zrem(index, *stale)
        found += [_decode(raw) for raw in raws if raw is not None]
        if len(found) > limit:
            return found[:limit], True
        if len(ids) < want:
            return found, False
        cursor = _text(ids[-1])


async def save_file(redis: aioredis.Redis, keys: Keys, store: FileStore, chunks: AsyncIterator[bytes], *,
                    tenant: str, purpose: str, filename: str, now: float | None = None) -> FileMeta:
    """Store a file batchgate makes (a batch's output: purpose "batch_output") under a new id and record it.
    The bytes are stored first, so a recorded file always has them; if recording fails they are deleted."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    file_id = new_file_id()
    counted = LineCount()
    size = await store.write(file_id, counted.count(chunks))
    meta = FileMeta(id=file_id, tenant=tenant, bytes=size, lines=counted.lines,
                    created_at=int(time.time() if now is None else now), filename=filename, purpose=purpose,
                    key=file_id)
    try:
        await put_meta(redis, keys, meta)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(store.delete(file_id))
        raise
    return meta


class LineCount:
    """The lines of a stream of chunks, counted as they pass (a last line without a newline counts)."""

    def __init__(self) -> None:
        self.newlines = 0
        self._last = b"\n"

    @property
    def lines(self) -> int:
        return self.newlines + (self._last != b"\n")

    async def count(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            if chunk:
                self.newlines += chunk.count(b"\n")
                self._last = chunk[-1:]
            yield chunk
