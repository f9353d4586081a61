"""The file store's contract, one suite against both adapters (a directory; S3 through moto's server on
loopback); the line rules of an uploaded batch file; the file records and their listing (over fakeredis)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from shared import files
from shared.api_errors import BadRequest, PayloadTooLarge
from shared.config import Settings
from shared.embedded_redis import free_port
from shared.files import FileMeta, FileStore, LocalFileStore, S3FileStore
from shared.jsonl import LineCheck
from shared.keys import Keys

BUCKET = "bg-files"


async def chunks_of(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(0)
        yield part


async def failing(after: list[bytes]) -> AsyncIterator[bytes]:
    for part in after:
        yield part
    raise RuntimeError("the upload broke")


async def read_all(store: FileStore, key: str, start: int = 0) -> bytes:
    return b"".join([c async for c in store.read(key, start)])


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FileStore:
    if request.param == "local":
        return LocalFileStore(tmp_path / "files")
    return S3FileStore(BUCKET, f"t{secrets.token_hex(4)}/", request.getfixturevalue("s3"))


def leftovers(store: FileStore) -> list[str]:
    """What a failed write could have left: temporary files, or unfinished multipart uploads."""
    if isinstance(store, LocalFileStore):
        return sorted(p.name for p in store.directory.iterdir()) if store.directory.exists() else []
    assert isinstance(store, S3FileStore)
    uploads = store.client.list_multipart_uploads(Bucket=BUCKET, Prefix=store.prefix).get("Uploads", [])
    objects = store.client.list_objects_v2(Bucket=BUCKET, Prefix=store.prefix).get("Contents", [])
    return [u["Key"] for u in uploads] + [o["Key"] for o in objects]


# --- the store contract ------------------------------------------------------------------------------


async def test_write_read_size_delete(store: FileStore):
    data = [b'{"a": 1}\n', b"x" * 100_000, b"\n", b"tail"]
    assert await store.write("file-one", chunks_of(*data)) == sum(map(len, data))
    whole = b"".join(data)
    assert await read_all(store, "file-one") == whole
    assert await store.size("file-one") == len(whole)
    await store.delete("file-one")
    assert await store.size("file-one") is None
    await store.delete("file-one")  # idempotent
    with pytest.raises(FileNotFoundError):
        await read_all(store, "file-one")


async def test_read_from_an_offset(store: FileStore):
    data = bytes(range(256)) * 1000  # 256 000 bytes: several read chunks
    await store.write("k", chunks_of(data[:70_000], data[70_000:]))
    for start in (0, 1, 65_535, 65_536, 200_001, len(data) - 1):
        assert await read_all(store, "k", start) == data[start:], start
    assert await read_all(store, "k", len(data)) == b""  # at the end: nothing
    assert await read_all(store, "k", len(data) + 10) == b""  # past it: nothing
    with pytest.raises(ValueError):
        await read_all(store, "k", -1)


async def test_an_empty_file(store: FileStore):
    assert await store.write("empty", chunks_of()) == 0
    assert await store.size("empty") == 0 and await read_all(store, "empty") == b""


async def test_a_failed_write_leaves_nothing_and_keeps_what_was_there(store: FileStore):
    with pytest.raises(RuntimeError, match="broke"):
        await store.write("k", failing([b"half a file\n"] * 3))
    assert await store.size("k") is None and leftovers(store) == []
    await store.write("k", chunks_of(b"v1\n"))
    with pytest.raises(RuntimeError):
        await store.write("k", failing([b"v2 partial"]))
    assert await read_all(store, "k") == b"v1\n"  # the earlier object is untouched
    await store.write("k", chunks_of(b"v2\n"))  # a whole write replaces it
    assert await read_all(store, "k") == b"v2\n"


async def test_a_cancelled_write_leaves_nothing(store: FileStore):
    gate = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield b"a" * 1000
        gate.set()
        await asyncio.sleep(3600)
        yield b"never"

    task = asyncio.create_task(store.write("k", stalls()))
    await gate.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.size("k") is None and leftovers(store) == []


@pytest.mark.parametrize("key", ["../up", "a/b", ".hidden", "", "x" * 201, "sp ace"])
async def test_keys_are_plain_names(store: FileStore, key: str):
    with pytest.raises(ValueError, match="key"):
        await store.write(key, chunks_of(b"x"))
    with pytest.raises(ValueError, match="key"):
        await store.size(key)


async def test_s3_writes_a_long_file_as_a_multipart_upload(s3: Any):
    store = S3FileStore(BUCKET, "long/", s3)
    piece = bytes(range(256)) * 256  # 64 KiB
    n = (files.S3_PART_BYTES * 2 + 3 * len(piece)) // len(piece)  # two whole parts and a short last one
    assert await store.write("big", chunks_of(*[piece] * n)) == n * len(piece)
    assert await store.size("big") == n * len(piece)
    head = s3.head_object(Bucket=BUCKET, Key="long/big")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    start = files.S3_PART_BYTES + 5
    got = await read_all(store, "big", start)
    assert len(got) == n * len(piece) - start and got[:10] == (piece * 2)[start % len(piece):][:10]
    with pytest.raises(RuntimeError):  # a long write that fails aborts its upload
        await store.write("big2", failing([piece] * n))
    assert leftovers(store) == ["long/big"]


def test_the_factory_picks_s3_only_when_a_bucket_is_named(tmp_path: Path):
    local = files.file_store(Settings(files_dir=str(tmp_path)))
    assert isinstance(local, LocalFileStore) and local.directory == tmp_path
    default = files.file_store(Settings())
    assert isinstance(default, LocalFileStore) and default.directory.parts[-2:] == ("batchgate", "files")
    env = {"BATCHGATE_FILES_S3_BUCKET": "b", "BATCHGATE_FILES_S3_PREFIX": "p/", "XDG_DATA_HOME": str(tmp_path)}
    settings = Settings.from_environ(env)
    assert settings.files_dir == str(tmp_path / "batchgate" / "files")
    assert (settings.files_s3_bucket, settings.files_s3_prefix) == ("b", "p/")
    assert (settings.max_file_bytes, settings.max_file_lines) == (200 << 20, 50_000)


# --- the line rules ------------------------------------------------------------------------------------


def check(**limits: int) -> LineCheck:
    return LineCheck(**{"max_bytes": 10_000, "max_lines": 10, "max_line_bytes": 200, **limits})


async def run_check(lc: LineCheck, *parts: bytes) -> bytes:
    return b"".join([c async for c in lc.check(chunks_of(*parts))])


@pytest.mark.parametrize("parts", [
    (b'{"a": 1}\n{"b": 2}\n',),
    (b'{"a": 1}\n{"b": 2}',),  # no final newline
    (b'{"a": "\\ud83d\\ude00"}\n{"b": 2}\n',),  # a surrogate pair escape: one character
    (b'{"a": 1}\r\n{"b": 2}\r\n',),  # CRLF
    tuple(bytes([b]) for b in b'{"a": 1}\n{"b": "\xc3\xa9"}\n'),  # byte by byte: lines and characters split
    (b'\xef\xbb', b'\xbf{"a": 1}\r\n{"b": 2}\r\n'),  # a byte order mark first (Windows' editors), split too
])
async def test_valid_files_pass_through_counted(parts: tuple[bytes, ...]):
    lc = check()
    assert await run_check(lc, *parts) == b"".join(parts)
    assert (lc.lines, lc.size) == (2, len(b"".join(parts)))


@pytest.mark.parametrize(("body", "message"), [
    (b"", "the file is empty"),
    (b'{}\n\n{}\n', "line 2 is empty"),
    (b'{}\n   \n', "line 2 is empty"),
    (b'{}\n[1, 2]\n', "line 2 is an array"),
    (b'"text"\n', "line 1 is a string"),
    (b'{"a": 1}\n{"a": \n', "line 2 is not valid JSON"),
    (b'{"a": "\xff"}\n', "line 1 is not valid JSON in UTF-8"),
    # a lone surrogate: no UTF-8 can carry it (msgspec's own message, "Input data was truncated", misleads)
    (b'{"a": "\\ud800"}\n', "line 1 is not valid JSON in UTF-8: it holds a lone UTF-16 surrogate escape"),
    (b'{"a": "x\\uDC00y"}\n', "line 1 is not valid JSON in UTF-8: it holds a lone UTF-16 surrogate escape"),
    (b'{"a": "\\ud800\n', "line 1 is not valid JSON in UTF-8: Input data was truncated"),  # truncated indeed
    (b'{}\n\xef\xbb\xbf{}\n', "line 2 is not valid JSON"),  # a byte order mark is one only before the first line
    (b'{}\n' * 11, "more than 10 lines"),
    (b'{"a": "' + b"x" * 300 + b'"}\n', "line 1 is longer than 200 bytes"),
    (b'{}\n{"a": "' + b"x" * 300, "line 2 is longer than 200 bytes"),  # refused before its end arrives
])
async def test_files_that_break_a_rule_are_refused_naming_the_line(body: bytes, message: str):
    with pytest.raises(BadRequest, match=message):
        await run_check(check(), body[:7], body[7:])


async def test_a_file_over_the_size_limit_is_a_413_as_soon_as_it_passes_it():
    lc = check(max_bytes=100, max_lines=1000)
    passed = []
    with pytest.raises(PayloadTooLarge, match="100 bytes"):
        async for chunk in lc.check(chunks_of(*[b"{}\n"] * 40)):
            passed.append(chunk)
    assert sum(map(len, passed)) <= 100


async def test_line_count_counts_a_last_line_without_newline():
    for parts, lines in (((b"a\nb",), 2), ((b"a\n", b"b\n"), 2), ((), 0), ((b"a\n", b""), 1)):
        counted = files.LineCount()
        assert b"".join([c async for c in counted.count(chunks_of(*parts))]) == b"".join(parts)
        assert counted.lines == lines, parts


# --- records and listing ------------------------------------------------------------------------------


def meta(file_id: str, tenant: str = "acme", purpose: str = "batch") -> FileMeta:
    return FileMeta(id=file_id, tenant=tenant, bytes=3, lines=1, created_at=1, filename="in.jsonl",
                    purpose=purpose, key=file_id)


@pytest.fixture
async def redis() -> AsyncIterator[Any]:
    client = fakeredis.FakeAsyncRedis()
    yield client
    await client.aclose()


async def test_ids_are_unguessable_and_sorted_by_creation():
    ids = [files.new_file_id(ms) for ms in (1_000, 2_000, 3_000, 3_001)]
    assert ids == sorted(ids) and all(files.is_file_id(i) for i in ids)
    assert files.new_file_id(5) != files.new_file_id(5)
    assert not files.is_file_id("file-x") and not files.is_file_id("req_" + ids[0][5:])


async def test_records_belong_to_their_tenant(redis: Any):
    keys = Keys("t")
    m = meta(files.new_file_id())
    await files.put_meta(redis, keys, m)
    assert await files.get_meta(redis, keys, m.id) == m
    assert await files.get_meta(redis, keys, m.id, tenant="acme") == m
    assert await files.get_meta(redis, keys, m.id, tenant="globex") is None
    assert await files.get_meta(redis, keys, "file-nope") is None
    await files.delete_meta(redis, keys, m)
    assert await files.get_meta(redis, keys, m.id) is None
    assert await files.list_meta(redis, keys, "acme") == ([], False)


async def test_listing_pages_in_either_order_by_purpose_and_skips_deleted_files(redis: Any):
    keys = Keys("t")
    ids = [files.new_file_id(1_000 * (i + 1)) for i in range(7)]
    for i, file_id in enumerate(ids):
        await files.put_meta(redis, keys, meta(file_id, purpose="batch_output" if i % 3 == 2 else "batch"))
    await files.put_meta(redis, keys, meta(files.new_file_id(), tenant="globex"))

    async def page(**kw: Any) -> tuple[list[str], bool]:
        found, more = await files.list_meta(redis, keys, "acme", **kw)
        return [m.id for m in found], more

    assert await page() == (ids[::-1], False)
    assert await page(order="asc", limit=3) == (ids[:3], True)
    assert await page(order="asc", limit=3, after=ids[2]) == (ids[3:6], True)
    assert await page(order="asc", limit=3, after=ids[5]) == (ids[6:], False)
    assert await page(limit=2, after=ids[2]) == ([ids[1], ids[0]], False)
    assert await page(purpose="batch_output") == ([ids[5], ids[2]], False)
    assert await page(purpose="batch", order="asc", limit=10) == ([ids[i] for i in (0, 1, 3, 4, 6)], False)
    # a file whose record is gone (deleted between two commands) is skipped and dropped from the index
    await redis.delete(keys.file(ids[1]))
    assert await page(order="asc", limit=2) == ([ids[0], ids[2]], True)
    assert await page(order="asc", limit=5) == ([ids[0], *ids[2:6]], True)
    assert await page(order="asc", limit=6) == ([ids[0], *ids[2:]], False)
    assert await redis.zcard(keys.files("acme")) == 6


async def test_save_file_stores_then_records(redis: Any, tmp_path: Path):
    keys, store = Keys("t"), LocalFileStore(tmp_path)
    lines = [json.dumps({"id": i}).encode() + b"\n" for i in range(4)]
    m = await files.save_file(redis, keys, store, chunks_of(*lines), tenant="acme", purpose="batch_output",
                              filename="out.jsonl", now=42)
    assert (m.bytes, m.lines, m.created_at, m.purpose, m.key) == (sum(map(len, lines)), 4, 42, "batch_output", m.id)
    assert await files.get_meta(redis, keys, m.id, "acme") == m
    assert await read_all(store, m.key) == b"".join(lines)
    with pytest.raises(ValueError, match="purpose"):
        await files.save_file(redis, keys, store, chunks_of(b"x"), tenant="acme", purpose="other", filename="f")


def test_a_bucket_that_is_not_there_or_not_ours_is_refused_at_start(s3: Any, monkeypatch: pytest.MonkeyPatch):
    """As the files directory is: a ConfigError naming BATCHGATE_FILES_S3_BUCKET, not a 503 on every upload."""
    from shared.errors import ConfigError
    from shared.startup_checks import check_file_store, s3_bucket_problem

    endpoint = s3.meta.endpoint_url
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    check_file_store(Settings(files_s3_bucket=BUCKET, files_s3_endpoint=endpoint))  # there: nothing to say
    with pytest.raises(ConfigError) as err:
        check_file_store(Settings(files_s3_bucket="no-such-bucket", files_s3_endpoint=endpoint))
    assert str(err.value).startswith("BATCHGATE_FILES_S3_BUCKET=no-such-bucket: there is no bucket")

    class Denied:
        def head_bucket(self, Bucket: str) -> None:
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadBucket")

    class Unreachable:
        def head_bucket(self, Bucket: str) -> None:
            from botocore.exceptions import EndpointConnectionError

            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    assert "may not use bucket 'b'" in (s3_bucket_problem(Denied(), "b") or "")
    assert s3_bucket_problem(Unreachable(), "b") is None  # no verdict: reached again per request
