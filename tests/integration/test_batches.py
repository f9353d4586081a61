"""The Batch API end to end: a real gateway, worker and batch runner on real Redis, driven by the official
`openai` client's `files` and `batches` resources."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI, BadRequestError, ConflictError, NotFoundError

from gateway.batch_runner import BatchRunner
from shared.batches import item_key
from shared.keys import Keys
from tests.integration.test_stack import wait_until
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]
CHAT = "/v1/chat/completions"


def jsonl(n: int, *, url: str = CHAT, start: int = 0, max_tokens: int = 4) -> bytes:
    lines = []
    for i in range(start, start + n):
        body = ({"model": "tiny-llama", "messages": [{"role": "user", "content": f"item {i}"}],
                 "max_tokens": max_tokens, "temperature": 0} if url == CHAT
                else {"model": "minilm", "input": f"text {i}"})
        lines.append(json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


@contextlib.asynccontextmanager
async def runner(settings, **kw) -> AsyncIterator[BatchRunner]:
    r = BatchRunner(settings, poll_s=0.05, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop))
    try:
        yield r
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def until_done(client: AsyncOpenAI, batch_id: str, timeout: float = 120) -> object:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        b = await client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert asyncio.get_running_loop().time() < end, b
        await asyncio.sleep(0.1)


async def lines_of(client: AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines() if x.strip()]


def code_of(line: dict) -> str:
    """An error line's code: in `error` for a line that never ran, else in its response's body."""
    return line["error"]["code"] if line["error"] is not None else line["response"]["body"]["error"]["code"]


def client_for(gw) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)


async def test_a_batch_runs_every_line_once_and_answers_in_openais_format(redis_url, prefix, loaded_models,
                                                                        tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw, runner(settings):
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(40))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                        metadata={"run": "t1"})
        assert b.status == "validating" and b.metadata == {"run": "t1"}
        done = await until_done(client, b.id)
        assert done.status == "completed" and done.request_counts.total == 40
        assert done.request_counts.completed == 40 and done.request_counts.failed == 0
        out = await lines_of(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"c-{i}" for i in range(40))
        assert [x["custom_id"] for x in out] == [f"c-{i}" for i in range(40)]  # in input order
        first = out[0]["response"]
        assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion"
        assert first["body"]["usage"]["completion_tokens"] == 4 and done.error_file_id is None
        # OpenAI's batch object: the model its lines name, and the tokens they computed
        assert done.model == "tiny-llama" and done.usage is not None
        assert done.usage.output_tokens == 40 * 4
        assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
        # the native request behind a line ran at batch priority
        native = (await gw.client.get(f"/v1/requests/{first['request_id']}")).json()
        assert native["priority"] == "batch" and native["status"] == "succeeded"
        listed = await client.batches.list(limit=10)
        assert b.id in [x.id for x in listed.data]
        # the Responses API's lines: each answered with a response, as POST /v1/responses answers it
        lines = [json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses", "body": {
            "model": "tiny-llama", "input": f"hi {i}", "instructions": "be brief", "max_output_tokens": 4}})
            for i in range(3)]
        # (written as Windows' editors write it: a byte order mark first, CRLF line ends)
        f = await client.files.create(file=("r.jsonl", io.BytesIO(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())),
                                      purpose="batch")
        done = await until_done(client, (await client.batches.create(
            input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")).id)
        assert done.status == "completed" and done.request_counts.completed == 3, done
        out = await lines_of(client, done.output_file_id)
        bodies = [x["response"]["body"] for x in out]
        assert [b["object"] for b in bodies] == ["response"] * 3 and bodies[0]["instructions"] == "be brief"
        assert all(b["usage"]["output_tokens"] == 4 and b["output"][0]["type"] == "message" for b in bodies)


async def test_an_item_refused_for_the_queue_is_tried_again_and_only_a_hopeless_one_is_written_off(
        redis_url, prefix, loaded_models, tmp_path, monkeypatch):
    """Admission's estimate of the queue errs (a queue drains faster than forecast): an item refused because the
    queue ahead would pass its window's end is fed again seconds later, not failed; one whose own compute cannot
    fit before the window's end (`x-should-retry: false`) is what the window leaves undone: `batch_expired` at
    once (not a 429 telling the caller to resubmit), and the batch ends `expired`, as OpenAI ends one whose window
    left a request undone."""
    from gateway import batch_runner
    from shared.api_errors import TooManyRequests

    real = batch_runner.ops.submit
    calls: dict[str, int] = {}

    async def submit(q, body, spec, tenant, **kw):
        key = kw.get("idempotency_key", "")
        calls[key] = calls.get(key, 0) + 1
        line = next(n for n in range(4) if key == item_key(key.split("\x1f")[1], n, 0))
        if line == 1 and calls[key] <= 2:  # the queue, as estimated, would pass the window: twice
            raise TooManyRequests("deadline infeasible: estimated finish in 90000 ms", code="deadline_infeasible",
                                  retry_after=60)
        if line == 2:  # its own compute passes the window's end, whatever the queue
            raise TooManyRequests("deadline infeasible: this request needs about 90000 ms of compute",
                                  code="deadline_infeasible", retry_after=1, headers={"x-should-retry": "false"})
        return await real(q, body, spec, tenant, **kw)

    monkeypatch.setattr(batch_runner.ops, "submit", submit)
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw, runner(settings):
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(4))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="60s")
        done = await until_done(client, b.id, 40)
        assert done.status == "expired" and done.expired_at is not None, done
        assert done.expired_at < done.expires_at  # known at once: the batch did not wait out its window
        out, err = await lines_of(client, done.output_file_id), await lines_of(client, done.error_file_id)
        assert [x["custom_id"] for x in out] == ["c-0", "c-1", "c-3"]
        assert [x["custom_id"] for x in err] == ["c-2"] and code_of(err[0]) == "batch_expired"
        assert err[0]["response"] is None and err[0]["id"].startswith("batch_req_")
        key = item_key(b.id, 1, 0)
        assert calls[key] == 3  # refused twice for the queue, then fed (after ~2 s each, not its 60 s Retry-After)


async def test_an_invalid_line_fails_the_batch_before_anything_runs(redis_url, prefix, loaded_models, tmp_path,
                                                                    model_cache):
    # the runner counts a prompt's tokens with the model's own tokenizer, as a gateway with the model cache does
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"), model_cache_dir=str(model_cache))
    async with running_gateway(settings) as gw, runner(settings):  # no worker: nothing could run anyway
        client = client_for(gw)
        bad = jsonl(3) + jsonl(1, start=1) \
            + b'{"custom_id": "c-9", "method": "POST", "url": "/v1/chat/completions", "body": ' \
            + b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}}\n' \
            + json.dumps({"custom_id": "c-10", "method": "POST", "url": CHAT, "body": {  # past the model's context
                "model": "tiny-llama", "messages": [{"role": "user", "content": "word " * 5000}]}}).encode() + b"\n"
        f = await client.files.create(file=("in.jsonl", io.BytesIO(bad)), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        done = await until_done(client, b.id, 30)
        assert done.status == "failed" and done.output_file_id is None
        codes = {(e.line, e.code) for e in done.errors.data}
        assert (4, "duplicate_custom_id") in codes and (5, "invalid_request") in codes, codes
        assert (6, "context_length_exceeded") in codes, codes  # the code the same request gets interactively
        # the field as the line's endpoint names it (OpenAI's parameter), not the native body's
        assert next(e for e in done.errors.data if e.line == 5).param == "body.max_tokens"
        keys = Keys(prefix)
        queued = sum([await gw.service.redis.xlen(s) for s in keys.lane_streams("tiny-llama",
                                                                               ("short", "medium", "long"))])
        assert queued == 0  # nothing was submitted
        with pytest.raises(BadRequestError):
            await client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
        with pytest.raises(NotFoundError):
            await client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
        with pytest.raises(NotFoundError):
            await client.batches.retrieve("batch_nope")
        for missing in ({}, {"input_file_id": None}, {"input_file_id": 123}):  # a 400 naming the field, not a 404
            r = await gw.client.post("/v1/batches", json={"endpoint": CHAT, "completion_window": "24h", **missing})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id", r.text


async def test_cancel_stops_feeding_and_every_line_is_answered_once(redis_url, prefix, loaded_models, tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw, \
            runner(settings, in_flight=4):
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(60, max_tokens=32))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        while (await client.batches.retrieve(b.id)).request_counts.completed < 3:
            await asyncio.sleep(0.05)
        cancelling = await client.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await until_done(client, b.id)
        assert done.status == "cancelled"
        with pytest.raises(ConflictError):  # ended: nothing to cancel, as docs/batches.md says
            await client.batches.cancel(b.id)
        out, err = await lines_of(client, done.output_file_id), await lines_of(client, done.error_file_id)
        ids = [x["custom_id"] for x in out + err]
        assert sorted(ids) == sorted(f"c-{i}" for i in range(60)) and len(set(ids)) == 60
        # as OpenAI cancels: what was running finishes whole, into the output file; what had not started (or was
        # never sent) is `batch_cancelled`, with no response
        assert 3 <= len(out) < 60 and all(code_of(x) == "batch_cancelled" and x["response"] is None for x in err)
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 32 for x in out)
        assert done.request_counts.completed == len(out) and done.request_counts.failed == len(err)


async def test_a_batch_cancelled_before_it_was_validated_counts_every_line_it_answers(
        redis_url, prefix, loaded_models, tmp_path):
    """Cancelled while `validating` (no runner had read it yet): every line that is a request gets its
    `batch_cancelled` line; one that is not (no `custom_id` to key it by) gets none, and the counts add up: `total`
    is the lines written, never less than `failed`."""
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_gateway(settings) as gw:  # no runner yet: the batch stays `validating`
        client = client_for(gw)
        raw = jsonl(4) + b"{\"not\": \"a request\"}\n"
        f = await client.files.create(file=("in.jsonl", io.BytesIO(raw)), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        assert (await client.batches.retrieve(b.id)).status == "validating"
        await client.batches.cancel(b.id)
        async with runner(settings):
            done = await until_done(client, b.id, 30)
        assert done.status == "cancelled" and done.output_file_id is None
        err = await lines_of(client, done.error_file_id)
        assert [x["custom_id"] for x in err] == ["c-0", "c-1", "c-2", "c-3"]  # before: a line with custom_id null too
        assert all(code_of(x) == "batch_cancelled" for x in err)
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (4, 0, 4)


async def test_a_runner_that_dies_mid_batch_is_taken_over_without_a_lost_or_repeated_line(
        redis_url, prefix, loaded_models, tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(80, max_tokens=8))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        first = BatchRunner(settings, poll_s=0.05, in_flight=8, name="first")
        task = asyncio.create_task(first.run(asyncio.Event()))
        while (await client.batches.retrieve(b.id)).request_counts.completed < 10:
            await asyncio.sleep(0.05)
        task.cancel()  # as if killed: its lease is not released, its state is wherever it was
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gw.service.redis.delete(Keys(prefix).batch_lease(b.id))  # the lease lapsing, sooner
        async with runner(settings, in_flight=8):
            done = await until_done(client, b.id)
        assert done.status == "completed" and done.request_counts.completed == 80
        out = await lines_of(client, done.output_file_id)
        assert [x["custom_id"] for x in out] == [f"c-{i}" for i in range(80)]
        native_ids = [x["response"]["request_id"] for x in out]
        assert len(set(native_ids)) == 80  # each line one request: none submitted twice


async def test_a_runner_stalled_past_its_lease_leaves_the_batch_another_ended_as_it_is(
        redis_url, prefix, loaded_models, tmp_path):
    """A runner paused past its lease (a SIGSTOP, a long stall) while another took its batch over and ended it,
    completed or cancelled: resumed, it feeds nothing more, writes no file over the new runner's (they came out
    empty: a batch's lines are dropped once it ends), and neither moves its status nor ends it a second time; its
    lease's renewal fails instead of taking the lapsed lease again (a user's probe emptied a completed batch's output
    and turned a cancelled batch `completed` with a second webhook)."""
    from shared.batch_store import BatchStore

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        client = client_for(gw)
        store = BatchStore(gw.service.redis, Keys(prefix))
        for cancel in (False, True):
            f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(12, max_tokens=8))), purpose="batch")
            b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
            stale = BatchRunner(settings, poll_s=0.05, in_flight=4, name="stale")
            try:
                assert await store.lease(b.id, "stale", 15_000)
                assert await stale.validate(await store.get(b.id))
                seen = await store.get(b.id)  # the batch as the runner last read it, feeding, when it stalled
                assert seen is not None and seen.progress.status == "in_progress"
                await gw.service.redis.delete(Keys(prefix).batch_lease(b.id))  # its lease lapsing
                if cancel:
                    await client.batches.cancel(b.id)
                async with runner(settings, in_flight=4):
                    done = await until_done(client, b.id)
                assert done.status == ("cancelled" if cancel else "completed")
                files_before = (await lines_of(client, done.output_file_id), await lines_of(client, done.error_file_id))
                assert len(files_before[0]) + len(files_before[1]) == 12
                assert not await store.renew(b.id, "stale", 15_000)  # lapsed: lost, not taken again
                assert await stale.feed(seen) is None  # resumed: nothing fed, no end of its own
                await stale.finalize(await store.get(b.id) or seen, "completed")
                after = await client.batches.retrieve(b.id)
                assert after.model_dump() == done.model_dump()  # status, times, counts, file ids: as they were
                assert (await lines_of(client, after.output_file_id), await lines_of(client, after.error_file_id)) \
                    == files_before
            finally:
                await stale.q.close()


class StallingFiles:
    """A file store whose first write stalls, before it reads its first line, until `resume` is set (a runner paused
    as it writes a file, after every check it makes before)."""

    def __init__(self, inner) -> None:
        self.inner, self.stalled, self.resume = inner, asyncio.Event(), asyncio.Event()

    async def write(self, key, chunks):
        if not self.stalled.is_set():
            self.stalled.set()
            await self.resume.wait()
        return await self.inner.write(key, chunks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def a_written_batch(store, redis, prefix, *, lines: int = 6, failed: int = 2) -> str:
    """A batch in progress whose every line is written (`lines - failed` good ones), as its runner leaves it before
    finalizing, with a webhook to send at its end."""
    from shared.batches import BatchMeta, Written, new_batch_id

    now = int(time.time())
    meta = BatchMeta(id=new_batch_id(now * 1000), tenant="default", endpoint=CHAT, input_file_id="file-none",
                     completion_window="24h", created_at=now, expires_at=now + 86_400,
                     callback_url="http://127.0.0.1:9/hook")
    await store.create(meta)
    await store.set_fields(meta.id, total=lines, next=lines)
    assert await store.move(meta.id, "in_progress", "in_progress_at", now, from_=("validating",)) == "in_progress"
    for i in range(lines):
        ok = i >= failed
        await store.write_line(meta.id, i, Written(ok, {"id": f"batch_req_{i}", "custom_id": f"c-{i}",
                                                          "response": {"status_code": 200 if ok else 400}}))
    return meta.id


async def batch_webhooks(redis, prefix: str, batch_id: str) -> list[bytes]:
    return [fields[b"d"] for _, fields in await redis.xrange(Keys(prefix).callback_stream())
            if batch_id.encode() in fields[b"d"]]


async def file_text(runner_: BatchRunner, file_id: str | None) -> bytes | None:
    from shared import files

    meta = None if file_id is None else await files.get_meta(runner_.q.redis, runner_.q.keys, file_id)
    return None if meta is None else b"".join([c async for c in runner_.files.read(meta.key)])


async def test_a_runner_stalled_past_its_lease_while_writing_a_file_changes_nothing(redis_url, prefix, tmp_path):
    """A runner paused in the middle of writing the output file, past its lease, while another took the batch over
    and ended it: resumed, its write lands in files of its own attempt, which it deletes; the ended batch, its files,
    the tenant's file listing and its one webhook are as the new runner left them. (The writes were not fenced: the
    stale runner replaced the good output with what it read, and the lines are dropped once a batch ends.)"""
    from shared import files
    from shared.batch_store import BatchStore

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    stale = BatchRunner(settings, poll_s=0.05, name="stale")
    stale.files = stalling = StallingFiles(stale.files)
    try:
        store = BatchStore(stale.q.redis, Keys(prefix))
        batch_id = await a_written_batch(store, stale.q.redis, prefix)
        assert await store.lease(batch_id, "stale", 15_000)
        task = asyncio.create_task(stale.finalize(await store.get(batch_id), "completed"))
        await asyncio.wait_for(stalling.stalled.wait(), 10)
        await stale.q.redis.delete(Keys(prefix).batch_lease(batch_id))  # its lease lapsing
        async with runner(settings):
            for _ in range(200):
                st = await store.get(batch_id)
                if st.progress.status == "completed" and batch_id not in await store.active():
                    break
                await asyncio.sleep(0.05)
        done = await store.get(batch_id)
        assert done.progress.status == "completed" and (done.progress.completed, done.progress.failed) == (4, 2)
        out, err = (await file_text(stale, done.progress.output_file_id),
                    await file_text(stale, done.progress.error_file_id))
        assert out.count(b"\n") == 4 and err.count(b"\n") == 2
        listed = {m.id for m in (await files.list_meta(stale.q.redis, Keys(prefix), "default"))[0]}
        assert listed == {done.progress.output_file_id, done.progress.error_file_id}
        assert len(await batch_webhooks(stale.q.redis, prefix, batch_id)) == 1

        stalling.resume.set()
        await asyncio.wait_for(task, 10)
        after = await store.get(batch_id)
        assert after.progress == done.progress and after.meta == done.meta
        assert (await file_text(stale, after.progress.output_file_id),
                await file_text(stale, after.progress.error_file_id)) == (out, err)
        assert {m.id for m in (await files.list_meta(stale.q.redis, Keys(prefix), "default"))[0]} == listed
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(listed)  # the stale bytes deleted
        assert len(await batch_webhooks(stale.q.redis, prefix, batch_id)) == 1
    finally:
        await stale.q.close()


async def test_a_runner_that_dies_right_after_the_end_leaves_the_rest_to_the_next(redis_url, prefix, tmp_path,
                                                                                monkeypatch):
    """Ended, then killed before its webhook was queued and its working state dropped: the batch stays active, and the
    next runner that takes it queues the webhook (once) and drops the state; files of an earlier attempt that died
    while finalizing are deleted, the batch's own kept."""
    from shared import files
    from shared.batch_store import BatchStore

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    first = BatchRunner(settings, poll_s=0.05, name="first")
    try:
        store = BatchStore(first.q.redis, Keys(prefix))
        batch_id = await a_written_batch(store, first.q.redis, prefix)
        assert await store.lease(batch_id, "first", 15_000)
        assert (await store.begin_finalize(batch_id, "first", "completed", int(time.time()))).attempt == 1
        for ok, suffix in ((True, "output"), (False, "errors")):  # attempt 1 died after writing its files
            assert await first._write_file(await store.get(batch_id), 6, 1, ok=ok, suffix=suffix) is not None

        async def killed(batch_id: str) -> None:
            raise asyncio.CancelledError  # as if killed: nothing after the end runs

        monkeypatch.setattr(first, "after_end", killed)
        with contextlib.suppress(asyncio.CancelledError):
            await first.finalize(await store.get(batch_id), "completed")  # attempt 2: ends the batch
        ended = await store.get(batch_id)
        assert ended.progress.status == "completed" and batch_id in await store.active()
        assert await batch_webhooks(first.q.redis, prefix, batch_id) == []
        assert len((await files.list_meta(first.q.redis, Keys(prefix), "default"))[0]) == 4
        await first.q.redis.delete(Keys(prefix).batch_lease(batch_id))  # its lease lapsing

        async with runner(settings):
            for _ in range(200):
                if batch_id not in await store.active():
                    break
                await asyncio.sleep(0.05)
        after = await store.get(batch_id)
        assert after.progress == ended.progress and batch_id not in await store.active()
        assert len(await batch_webhooks(first.q.redis, prefix, batch_id)) == 1
        listed = {m.id for m in (await files.list_meta(first.q.redis, Keys(prefix), "default"))[0]}
        assert listed == {after.progress.output_file_id, after.progress.error_file_id}
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(listed)
        assert (await file_text(first, after.progress.output_file_id)).count(b"\n") == 4
        assert not await first.q.redis.exists(Keys(prefix).batch_lines(batch_id))
    finally:
        await first.q.close()


async def test_a_runner_that_dies_as_it_begins_finalizing_leaves_the_final_status_it_chose(redis_url, prefix, tmp_path):
    """Moved to `finalizing` for a cancel, then killed: the next runner ends the batch `cancelled` (the final status is
    recorded in the same script as the move; it was written after it, and a runner killed in between left the next
    one to end a cancelled batch `completed`). A second attempt keeps the status the first recorded."""
    from shared.batch_store import BatchStore

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    first = BatchRunner(settings, poll_s=0.05, name="first")
    try:
        store = BatchStore(first.q.redis, Keys(prefix))
        batch_id = await a_written_batch(store, first.q.redis, prefix)
        assert await store.begin_finalize(batch_id, "other", "cancelled", 1) == ("in_progress", 0, "")  # no lease
        assert await store.lease(batch_id, "first", 15_000)
        assert await store.begin_finalize(batch_id, "first", "cancelled", 1) == ("finalizing", 1, "cancelled")
        assert await store.begin_finalize(batch_id, "first", "completed", 2) == ("finalizing", 2, "cancelled")
        await first.q.redis.delete(Keys(prefix).batch_lease(batch_id))  # killed: its lease lapsing
        async with runner(settings):
            for _ in range(200):
                if batch_id not in await store.active():
                    break
                await asyncio.sleep(0.05)
        done = await store.get(batch_id)
        assert done.progress.status == "cancelled" and done.progress.times["finalizing_at"] == 1
        assert await store.begin_finalize(batch_id, "first", "completed", 3) == ("cancelled", 0, "")
    finally:
        await first.q.close()


async def test_a_cancel_accepted_as_the_last_line_finished_ends_the_batch_cancelled(redis_url, prefix, tmp_path):
    """The runner saw every line written and chose `completed`; a cancel accepted meanwhile (`cancelling`, answered
    to its caller) wins: the batch ends `cancelled`, as OpenAI's `cancelling` always does (it ended `completed`)."""
    from shared.batch_store import BatchStore

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    first = BatchRunner(settings, poll_s=0.05, name="first")
    try:
        store = BatchStore(first.q.redis, Keys(prefix))
        batch_id = await a_written_batch(store, first.q.redis, prefix)
        assert await store.move(batch_id, "cancelling", "cancelling_at", 5, from_=("in_progress",)) == "cancelling"
        assert await store.lease(batch_id, "first", 15_000)
        assert await store.begin_finalize(batch_id, "first", "completed", 6) == ("finalizing", 1, "cancelled")
        st = await store.get(batch_id)
        await first.finalize(st, "completed")
        done = await store.get(batch_id)
        assert done.progress.status == "cancelled" and "completed_at" not in done.progress.times
        assert done.progress.times["cancelled_at"] >= 6 and done.progress.completed == 4
    finally:
        await first.q.close()


async def test_a_batchs_end_is_a_signed_webhook_with_the_batch(redis_url, prefix, loaded_models, tmp_path):
    from shared.webhooks import verify
    from tests.integration.test_webhooks import SECRET, dispatcher, settings_for
    from tests.receiver import receiver

    settings = settings_for(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with receiver() as rx, running_worker(settings, loaded_models), running_gateway(settings) as gw, \
            dispatcher(settings), runner(settings):
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(5))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                        extra_body={"callback_url": rx.url})
        done = await until_done(client, b.id)
        await rx.wait_for(1)
        got = rx.requests[0]
        payload = verify(SECRET, got.body, got.headers)
        assert payload["id"] == b.id and payload["status"] == "completed" == done.status
        assert payload["output_file_id"] == done.output_file_id and got.headers["batchgate-event"] == "batch.completed"
        # a batch that fails validation ends too (OpenAI's batch.failed): before, it sent nothing
        dup = await client.files.create(file=("dup.jsonl", io.BytesIO(jsonl(2) + jsonl(1))), purpose="batch")
        bad = await client.batches.create(input_file_id=dup.id, endpoint=CHAT, completion_window="24h",
                                          extra_body={"callback_url": rx.url})
        assert (await until_done(client, bad.id)).status == "failed"
        await rx.wait_for(2)
        got = rx.requests[1]
        payload = verify(SECRET, got.body, got.headers)
        assert payload["id"] == bad.id and payload["status"] == "failed" and got.headers["batchgate-event"] == \
            "batch.failed"
        assert payload["errors"]["data"][0]["code"] == "duplicate_custom_id"
        with pytest.raises(TimeoutError):  # once: no second delivery of it
            await rx.wait_for(3, timeout=0.5)
        with pytest.raises(BadRequestError):  # a webhook to where the allow-list does not reach
            await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                        extra_body={"callback_url": "http://169.254.169.254/x"})
        with pytest.raises(BadRequestError) as err:  # a native endpoint's unknown model: refused at create
            await client.batches.create(input_file_id=f.id, endpoint="/v1/models/nope/requests",  # type: ignore
                                        completion_window="24h")
        assert err.value.code == "model_not_found" and err.value.param == "endpoint"


async def test_a_running_batchs_input_file_cannot_be_deleted(redis_url, prefix, loaded_models, tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_gateway(settings) as gw:  # no runner: the batch stays active
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        from openai import ConflictError

        with pytest.raises(ConflictError):
            await client.files.delete(f.id)
        await client.batches.cancel(b.id)
        async with runner(settings):
            assert (await until_done(client, b.id, 30)).status == "cancelled"
        assert (await client.files.delete(f.id)).deleted


async def _fed(r: BatchRunner, batch_id: str, n: int) -> bool:
    return len(await r.store.in_flight(batch_id)) >= n


async def test_items_a_batchs_window_left_unrun_are_batch_expired(redis_url, prefix, tmp_path):
    """The window ends with items submitted but never run (no worker here): they are stopped, and their lines say
    `batch_expired`, as OpenAI answers what a window left, not `batch_cancelled` as if the caller had cancelled."""
    import time

    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    skew = [0.0]  # the runner's clock, moved past the window once the items are in flight
    async with running_gateway(settings) as gw, runner(settings, clock=lambda: time.time() + skew[0]) as r:
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(3))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="60s")
        await wait_until(lambda: _fed(r, b.id, 3), timeout=20)
        skew[0] = 120.0
        done = await until_done(client, b.id, 30)
        assert done.status == "expired" and done.request_counts.failed == 3
        err = await lines_of(client, done.error_file_id)
        assert [line["error"]["code"] for line in err] == ["batch_expired"] * 3, err
        assert all(line["response"] is None for line in err)


async def test_a_request_that_expired_before_it_ran_is_fed_again_within_the_window(
        redis_url, prefix, loaded_models, tmp_path):
    """An item's deadline is its model's `max_timeout_s` where the window is longer: no worker for that long (an
    outage, workers scaled to zero) expires it unrun. The window still allows it, so the line is fed again (a new
    request), and it runs once a worker comes: never a 504 line, never a batch `completed` with failures it could
    have avoided."""
    import dataclasses

    from shared.config import BUILTIN_MODELS

    quick = dataclasses.replace(BUILTIN_MODELS["tiny-llama"], max_timeout_s=1.0)
    settings = make_settings(redis_url, prefix, models=(BUILTIN_MODELS["minilm"], quick),
                             files_dir=str(tmp_path / "files"), expiry_grace_s=0.2)
    async with running_gateway(settings) as gw, runner(settings) as r:
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(3))), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        await wait_until(lambda: _fed(r, b.id, 3), timeout=20)
        first = {ref.line: ref.request_id for ref in await r.store.in_flight(b.id)}

        async def fed_again() -> bool:
            refs = await r.store.in_flight(b.id)
            return len(refs) == 3 and all(ref.attempt >= 1 for ref in refs)

        await wait_until(fed_again, timeout=20)  # expired unrun (no worker): fed again, nothing answered
        assert (await client.batches.retrieve(b.id)).request_counts.failed == 0
        async with running_worker(settings, loaded_models):
            done = await until_done(client, b.id, 60)
        assert done.status == "completed" and done.request_counts.completed == 3 and done.error_file_id is None, done
        out = await lines_of(client, done.output_file_id)
        assert [x["custom_id"] for x in out] == ["c-0", "c-1", "c-2"]
        assert all(x["response"]["request_id"] != first[i] for i, x in enumerate(out))  # each line's later request
        for old in first.values():  # the first requests expired, unrun
            assert (await gw.client.get(f"/v1/requests/{old}")).json()["status"] == "expired"


async def test_batches_are_listed_newest_first_within_one_second(redis_url, prefix, tmp_path):
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_gateway(settings) as gw:  # no runner: they stay `validating`
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(1))), purpose="batch")
        made = [(await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")).id
                for _ in range(12)]
        listed = [x.id async for x in client.batches.list(limit=5)]
        assert listed == made[::-1]
        assert (await client.batches.list(limit=1)).data[0].id == made[-1]


async def test_a_cancel_while_a_file_is_validated_stops_its_validation(redis_url, prefix, tmp_path, monkeypatch):
    """Validation looks for a cancel as it reads (every `CANCEL_CHECK_LINES`): a 50,000-line file's cancel does not
    wait for every line to be checked, and a bad line past where it stopped does not fail the cancelled batch; a line
    repeating an earlier line's `custom_id` gets no line of its own (a caller keying the results by it saw it
    twice)."""
    from gateway import batch_runner

    monkeypatch.setattr(batch_runner, "CANCEL_CHECK_LINES", 2)
    settings = make_settings(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_gateway(settings) as gw:
        client = client_for(gw)
        f = await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(3) + jsonl(1))), purpose="batch")  # c-0 twice
        b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        await client.batches.cancel(b.id)
        async with runner(settings):
            done = await until_done(client, b.id, 30)
        assert done.status == "cancelled" and done.errors is None, done  # not `failed` for the line it never checked
        err = await lines_of(client, done.error_file_id)
        assert [code_of(x) for x in err] == ["batch_cancelled"] * 3
        assert [x["custom_id"] for x in err] == ["c-0", "c-1", "c-2"]
        assert (done.request_counts.total, done.request_counts.failed) == (3, 3)
