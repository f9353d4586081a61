"""The Files API through a real gateway on real Redis, driven by OpenAI's own client: upload, retrieve, list
(paged), content, delete; tenants; refused files leave nothing; a multi-MB upload passes through in bounded
chunks and memory; the stream of a whole body (Cloud Functions); the S3 store (moto, loopback)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from gateway import files_api, routes
from gateway.api import ApiRequest
from shared.files import LocalFileStore
from shared.keys import Keys
from tests.integration.test_sdk_auth import keys_for
from tests.stack import RunningGateway, make_settings, running_gateway

pytestmark = [pytest.mark.redis]


def jsonl(n: int, pad: int = 0) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "minilm", "input": "x" * pad}}).encode() + b"\n" for i in range(n))


def multipart(*fields: tuple[str, str | None, bytes], boundary: str = "b0und4ry") -> tuple[dict[str, str], bytes]:
    """A multipart/form-data body with its fields in the order given (httpx puts files last)."""
    out = b""
    for name, filename, value in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return {"content-type": f"multipart/form-data; boundary={boundary}"}, out + f"--{boundary}--\r\n".encode()


@pytest.fixture
async def clients() -> AsyncIterator[Any]:
    made: list[AsyncOpenAI] = []

    def make(gw: RunningGateway, key: str = "none") -> AsyncOpenAI:
        made.append(AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        await client.close()


async def nothing_stored(gw: RunningGateway, files_dir: Path, tenant: str = "default") -> bool:
    keys = Keys(gw.service.settings.key_prefix)
    on_disk = list(files_dir.iterdir()) if files_dir.exists() else []
    return not on_disk and await gw.service.redis.zcard(keys.files(tenant)) == 0


async def test_upload_retrieve_list_content_delete(redis_url, prefix, tmp_path, clients):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path))
    async with running_gateway(settings) as gw:
        client = clients(gw)
        data = jsonl(5)
        created = await client.files.create(file=("input.jsonl", data), purpose="batch")
        assert created.id.startswith("file-") and created.object == "file"
        assert (created.bytes, created.filename, created.purpose, created.status) == (len(data), "input.jsonl",
                                                                                      "batch", "processed")
        assert created.expires_at is None and abs(created.created_at - gw.service.clock()) < 5
        assert await client.files.retrieve(created.id) == created
        page = await client.files.list()
        assert [f.id for f in page.data] == [created.id] and page.has_more is False
        assert (await client.files.list(purpose="batch_output")).data == []
        assert (await client.files.list(purpose="fine-tune")).data == []
        assert (await client.files.content(created.id)).content == data
        async with client.files.with_streaming_response.content(created.id) as resp:
            assert resp.headers["content-type"] == "application/octet-stream"
            assert resp.headers["content-length"] == str(len(data))
            assert b"".join([c async for c in resp.iter_bytes()]) == data
        deleted = await client.files.delete(created.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "file")
        for call in (client.files.retrieve, client.files.content, client.files.delete):
            with pytest.raises(openai.NotFoundError) as info:
                await call(created.id)
            assert info.value.code == "file_not_found"
        assert await nothing_stored(gw, tmp_path)


async def test_listing_pages_newest_first_by_default(redis_url, prefix, tmp_path, clients):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path))
    async with running_gateway(settings) as gw:
        client = clients(gw)
        ids = []
        for i in range(5):
            ids.append((await client.files.create(file=(f"f{i}.jsonl", jsonl(1)), purpose="batch")).id)
            await asyncio.sleep(0.002)  # ids order by their millisecond
        first = await client.files.list(limit=2)
        assert [f.id for f in first.data] == ids[:2:-1][:2] and first.has_more is True
        assert [f.id async for f in client.files.list(limit=2)] == ids[::-1]  # the client follows `after`
        asc = await client.files.list(limit=3, order="asc", after=ids[0])
        assert [f.id for f in asc.data] == ids[1:4] and asc.has_more
        raw = (await gw.client.get("/v1/files", params={"limit": 2, "order": "asc"})).json()
        assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", ids[0], ids[1], True)
        # an integer as a query string writes it: ASCII digits (int() took "+2", " 2", "1_0" and other scripts' digits,
        # which the API document's integer is not: a fuzzer's "٣" listed batches)
        odd = [{"limit": v} for v in ("+2", " 2", "1_0", "٣", "²")]
        for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                              ({"after": "nope"}, "after"), *((p, "limit") for p in odd)):
            r = await gw.client.get("/v1/files", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        for params in odd:
            r = await gw.client.get("/v1/batches", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", (params, r.text)


async def test_files_belong_to_their_tenant(redis_url, prefix, tmp_path, clients):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path), auth="api_key")
    async with running_gateway(settings) as gw:
        acme_key, globex_key = await keys_for(gw, "acme", "globex")
        acme, globex = clients(gw, acme_key), clients(gw, globex_key)
        created = await acme.files.create(file=("a.jsonl", jsonl(2)), purpose="batch")
        for call in (globex.files.retrieve, globex.files.content, globex.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(created.id)
        assert (await globex.files.list()).data == []
        assert (await acme.files.retrieve(created.id)).id == created.id  # still there: globex deleted nothing
        with pytest.raises(openai.AuthenticationError):
            await clients(gw, "wrong").files.create(file=("a.jsonl", jsonl(1)), purpose="batch")


async def test_refused_uploads_leave_nothing(redis_url, prefix, tmp_path, clients):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path), max_file_bytes=64 << 10, max_file_lines=50)
    async with running_gateway(settings) as gw:
        client = clients(gw)
        cases: list[tuple[Any, dict[str, Any], int, str]] = [
            (openai.APIStatusError, {"file": ("big.jsonl", jsonl(40, pad=2000))}, 413, "larger than the limit"),
            (openai.BadRequestError, {"file": ("many.jsonl", jsonl(51))}, 400, "more than 50 lines"),
            (openai.BadRequestError, {"file": ("bad.jsonl", jsonl(3) + b"[]\n")}, 400, "line 4 is an array"),
            (openai.BadRequestError, {"file": ("bad.jsonl", b'{"a": "\xff"}\n')}, 400, "not valid JSON in UTF-8"),
            (openai.BadRequestError, {"file": ("e.jsonl", b"")}, 400, "the file is empty"),
            (openai.BadRequestError, {"file": ("f.jsonl", jsonl(1)), "purpose": "fine-tune"}, 400, "purpose"),
            (openai.BadRequestError, {"file": ("f.jsonl", jsonl(1)), "purpose": "batch_output"}, 400,
             "made by batchgate"),
        ]
        for error, kwargs, status, message in cases:
            with pytest.raises(error) as info:
                await client.files.create(**{"purpose": "batch", **kwargs})
            assert info.value.status_code == status and message in info.value.message, info.value.message
        assert await nothing_stored(gw, tmp_path)
        r = await gw.client.post("/v1/files", json={"purpose": "batch"})
        assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's shape
        # the purpose after the file: the file, stored first, is deleted when the purpose is refused
        for fields, status in ((multipart(("file", "x.jsonl", jsonl(2)), ("purpose", None, b"vision")), 400),
                               (multipart(("file", "x.jsonl", jsonl(2))), 400),
                               (multipart(("file", "x.jsonl", jsonl(1)), ("file", "y.jsonl", jsonl(1)),
                                          ("purpose", None, b"batch")), 400),
                               (multipart(("purpose", None, b"batch"), ("file", "x.jsonl", jsonl(1)),
                                          ("expires_after[anchor]", None, b"created_at")), 400)):
            headers, body = fields
            r = await gw.client.post("/v1/files", content=body, headers=headers)
            assert r.status_code == status, r.text
        headers, body = multipart(("file", "x.jsonl", jsonl(1)), ("purpose", None, b"batch"))
        r = await gw.client.post("/v1/files", content=body[:-20], headers=headers)  # cut before its end
        assert r.status_code == 400 and "ended before its closing boundary" in r.text
        assert await nothing_stored(gw, tmp_path)
        r = await gw.client.post("/v1/files", content=body, headers=headers)  # the purpose last is fine
        assert r.status_code == 200 and r.json()["filename"] == "x.jsonl"


async def test_a_body_far_over_the_limit_is_refused_without_being_stored(redis_url, prefix, tmp_path, clients):
    """Declared (Content-Length) and undeclared (chunked): both a 413 the client reads, nothing kept."""
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path), max_file_bytes=1 << 20)
    async with running_gateway(settings) as gw:
        client = clients(gw)
        big = jsonl(400, pad=10_000)  # about 4 MB
        with pytest.raises(openai.APIStatusError) as info:
            await client.files.create(file=("big.jsonl", big), purpose="batch")
        assert info.value.status_code == 413
        headers, body = multipart(("purpose", None, b"batch"), ("file", "big.jsonl", big))

        async def chunked() -> AsyncIterator[bytes]:
            for i in range(0, len(body), 50_000):
                yield body[i:i + 50_000]

        r = await gw.client.post("/v1/files", content=chunked(), headers=headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
        assert await nothing_stored(gw, tmp_path)


class SpyStore(LocalFileStore):
    """The local store, noting the largest chunk the gateway hands it."""

    largest = 0

    async def write(self, key: str, chunks: AsyncIterator[bytes]) -> int:
        async def spied() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                SpyStore.largest = max(SpyStore.largest, len(chunk))
                yield chunk

        return await super().write(key, spied())


@pytest.fixture
def spy_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    files_dir = tmp_path / "files"
    monkeypatch.setattr(files_api, "file_store", lambda settings: SpyStore(files_dir))
    SpyStore.largest = 0
    yield files_dir


async def test_a_multi_megabyte_upload_is_streamed_not_held(redis_url, prefix, tmp_path, spy_store, clients):
    settings = make_settings(redis_url, prefix)
    source = tmp_path / "input.jsonl"
    line = json.dumps({"custom_id": "r", "body": {"input": "y" * 60_000}}).encode() + b"\n"
    with source.open("wb") as f:
        for _ in range(600):  # about 36 MB
            f.write(line)
    size = source.stat().st_size
    async with running_gateway(settings) as gw:
        client = clients(gw)
        tracemalloc.start()
        try:
            with source.open("rb") as f:  # httpx reads it in chunks: the client holds none of it whole either
                created = await client.files.create(file=f, purpose="batch")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert created.bytes == size and created.filename == "input.jsonl"
        assert 0 < SpyStore.largest <= 1 << 20, SpyStore.largest  # the store got the body as it came
        assert peak < size / 6, f"peak {peak} bytes traced while uploading {size} bytes"
        digest = hashlib.sha256()
        async with client.files.with_streaming_response.content(created.id) as resp:
            async for chunk in resp.iter_bytes():
                digest.update(chunk)
        assert digest.hexdigest() == hashlib.sha256(source.read_bytes()).hexdigest()
        assert (spy_store / created.id).stat().st_size == size


async def test_a_stalled_upload_is_a_408_and_leaves_nothing(redis_url, prefix, tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path), body_timeout_s=0.5)
    async with running_gateway(settings) as gw:
        headers, body = multipart(("purpose", None, b"batch"), ("file", "x.jsonl", jsonl(100)))
        port = int(gw.base_url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: {headers['content-type']}\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # read() to EOF: the gateway closes the connection
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
        assert await nothing_stored(gw, tmp_path)


async def test_a_whole_body_transport_uploads_and_reads_content(redis_url, prefix, tmp_path):
    """Cloud Functions (and direct calls) hand `routes.handle` the body whole: one chunk; content collected."""
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path))
    async with running_gateway(settings) as gw:
        data = jsonl(3)
        headers, body = multipart(("purpose", None, b"batch"), ("file", "in.jsonl", data))
        resp = await routes.handle(gw.service, ApiRequest("POST", "/v1/files", headers=headers, body=body))
        assert resp.status == 200 and resp.body["bytes"] == len(data)
        got = await routes.handle(gw.service, ApiRequest("GET", f"/v1/files/{resp.body['id']}/content"))
        assert got.status == 200 and got.render(None) == (data, "application/octet-stream")


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import boto3
    from moto.server import ThreadedMotoServer

    from shared.embedded_redis import free_port

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bg-files")
    yield url
    server.stop()


async def test_the_s3_store_behind_the_gateway(redis_url, prefix, moto_s3, clients):
    import boto3

    folder = f"{secrets.token_hex(3)}/"
    settings = make_settings(redis_url, prefix, files_s3_bucket="bg-files", files_s3_prefix=folder,
                             files_s3_endpoint=moto_s3)
    async with running_gateway(settings) as gw:
        client = clients(gw)
        data = jsonl(10)
        created = await client.files.create(file=("s3.jsonl", data), purpose="batch")
        s3 = boto3.client("s3", endpoint_url=moto_s3)
        assert s3.get_object(Bucket="bg-files", Key=folder + created.id)["Body"].read() == data
        assert (await client.files.content(created.id)).content == data
        await client.files.delete(created.id)
        assert s3.list_objects_v2(Bucket="bg-files", Prefix=folder).get("KeyCount") == 0
