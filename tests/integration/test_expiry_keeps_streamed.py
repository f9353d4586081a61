"""A streaming request whose worker went quiet past its deadline is expired by whoever reads it (a gateway, the
webhook dispatcher): what its caller was already sent is its output, as a worker's own deadline cut keeps its
partial output; the OpenAI routes then answer that text (`finish_reason` length), not "before any output"."""

from __future__ import annotations

import time

import pytest

from shared import openai_shapes as oa
from shared.messages import StreamDelta
from shared.records import streamed_output
from shared.states import FinishReason, Status
from shared.views import record_view
from tests.fakes import make_request
from tests.integration.test_outbox import parts  # noqa: F401  (the fixture: a client, keys, a store, a queue)


def test_the_streamed_output_is_the_contiguous_deltas_from_the_first() -> None:
    lp = ({"token": "a", "logprob": -0.1},)
    deltas = [StreamDelta(0, (5,), "a", logprobs=lp, prompt_tokens=3), StreamDelta(1, (6, 7), "bc", logprobs=lp * 2),
              StreamDelta(1, (6,), "b"),  # a second attempt's overlap: already had
              StreamDelta(3, (8,), "d", logprobs=lp, prompt_tokens=9)]
    assert streamed_output(deltas) == {"text": "abcd", "token_ids": [5, 6, 7, 8], "completion_tokens": 4,
                                       "prompt_tokens": 3, "logprobs": list(lp * 4)}
    echoed = [StreamDelta(0, (5,), "a", prompt_tokens=2, prompt_token_ids=(1, 2)), StreamDelta(1, (6,), "b")]
    assert streamed_output(echoed)["prompt_token_ids"] == [1, 2]  # `params.echo`: the prompt's ids, sent first
    assert streamed_output([StreamDelta(0, (5,), "a"), StreamDelta(2, (7,), "c")]) == {
        "text": "a", "token_ids": [5], "completion_tokens": 1}  # a gap: what follows it was never sent in order
    assert "logprobs" not in streamed_output([StreamDelta(0, (5,), "a", logprobs=lp), StreamDelta(1, (6,), "b")])
    assert streamed_output([]) is None and streamed_output([StreamDelta(1, (5,), "b")]) is None


async def queued(client, store, rid: str):
    """A request queued with a deadline 50 ms away (the record as a submit writes it)."""
    req = make_request(rid, timeout_s=0.05)
    pipe = client.pipeline(transaction=False)
    await store.init_in(pipe, req, int(time.time() * 1000))
    await pipe.execute()
    return req


@pytest.mark.redis
async def test_an_expiry_after_streamed_tokens_keeps_them_as_the_output(parts) -> None:  # noqa: F811
    client, _, store, queue = parts
    req = await queued(client, store, "req_cut")
    await store.start([req], int(time.time() * 1000))
    await queue.publish_deltas([(req.id, StreamDelta(0, (5, 6), "he", prompt_tokens=1), True)])
    await queue.publish_deltas([(req.id, StreamDelta(2, (7,), "y"), False)])
    time.sleep(0.1)  # its deadline passes; its worker wrote nothing more
    events = store.keys.events(req.id)
    await client.pexpire(events, 2000)  # no dispatcher ran for long: the deltas are near their end, the record not
    assert await store.expire_overdue(await store.get(req.id), int(time.time() * 1000), 0.0, "gateway")
    rec = await store.get(req.id)
    assert rec.state is Status.EXPIRED and rec.result.finish_reason is FinishReason.DEADLINE
    # the deltas are kept as long as the result: a stream resumed from its last event id is not sent them again
    assert await client.pttl(events) > store.result_ttl_ms - 5000 > 2000
    assert await client.pttl(events) >= await client.pttl(store.keys.record(req.id)) - 1000
    assert rec.result.output == {"text": "hey", "token_ids": [5, 6, 7], "completion_tokens": 3, "prompt_tokens": 1}
    assert "3 tokens were streamed" in rec.result.error.message
    assert oa.result_error(record_view(rec)) is None  # OpenAI callers get the text, cut by the deadline


@pytest.mark.redis
async def test_an_expiry_before_any_token_has_no_output(parts) -> None:  # noqa: F811
    client, _, store, _ = parts
    req = await queued(client, store, "req_none")
    time.sleep(0.1)
    assert await store.expire_overdue(await store.get(req.id), int(time.time() * 1000), 0.0, "gateway")
    rec = await store.get(req.id)
    assert rec.state is Status.EXPIRED and rec.result.output is None
    assert rec.result.error.message == "no result by the deadline"
    assert oa.result_error(record_view(rec)).status == 504


@pytest.mark.redis
async def test_a_cancel_no_worker_answers_keeps_what_was_streamed(parts, redis_url, prefix, monkeypatch) -> None:  # noqa: F811
    """A DELETE of a running streamed request whose worker is gone: the gateway writes the cancelled record itself
    after `CANCEL_GRACE_S`, its output the tokens its caller was sent (a worker's own cancel keeps them too), so the
    deltas add up to the final output; a cancel before any token has none."""
    from shared import queue_client
    from shared.config import ModelSpec, Settings
    from shared.states import Task

    client, _, store, queue = parts
    monkeypatch.setattr(queue_client, "CANCEL_GRACE_S", 0.2)
    spec = ModelSpec(name="m", task=Task.GENERATE, source="", kind="echo").validate()
    q = queue_client.QueueClient(Settings(key_prefix=prefix, redis_url=redis_url, models=(spec,)).validate())
    await q.start()
    try:
        streamed, silent = make_request("req_sent"), make_request("req_quiet")
        for req in (streamed, silent):
            pipe = client.pipeline(transaction=False)
            await store.init_in(pipe, req, int(time.time() * 1000))
            await pipe.execute()
        await store.start([streamed, silent], int(time.time() * 1000))
        await queue.publish_deltas([(streamed.id, StreamDelta(0, (5, 6), "he", prompt_tokens=1), True)])
        assert await q.cancel(await store.get(streamed.id))
        rec = await store.get(streamed.id)
        assert rec.state is Status.CANCELLED and rec.result.finish_reason is FinishReason.CANCELLED
        assert rec.result.output == {"text": "he", "token_ids": [5, 6], "completion_tokens": 2, "prompt_tokens": 1}
        assert rec.result.error.message == "cancelled by the caller after 2 tokens were streamed; partial output kept"
        assert await q.cancel(await store.get(silent.id))
        rec = await store.get(silent.id)
        assert rec.result.output is None and rec.result.error.message == "cancelled by the caller"
    finally:
        await q.close()


def racing_reads(monkeypatch, store, late_delta) -> list[int]:
    """The store's delta reads, counted; after each of the first reads `late_delta(n)` runs (a worker that writes a
    delta between the expiry's read and its write)."""
    reads: list[int] = []
    real = store.redis.xrange

    async def xrange(key, *args, **kwargs):
        got = await real(key, *args, **kwargs)
        reads.append(len(got))
        await late_delta(len(reads))
        return got

    monkeypatch.setattr(store.redis, "xrange", xrange)
    return reads


@pytest.mark.redis
async def test_a_delta_written_during_the_expiry_is_in_the_output(parts, monkeypatch) -> None:  # noqa: F811
    """The expiry reads the deltas, then writes them as the output with a check that none came between: a late worker
    (still running past its deadline and the grace) whose delta lands in between makes it read them again, so what
    the caller was streamed still adds up to the output; a delta after the end is refused (never streamed)."""
    client, _, store, queue = parts
    req = await queued(client, store, "req_race")
    await store.start([req], int(time.time() * 1000))
    await queue.publish_deltas([(req.id, StreamDelta(0, (5,), "a", prompt_tokens=1), True)])

    async def late_delta(n: int) -> None:
        if n == 1:
            await queue.publish_deltas([(req.id, StreamDelta(1, (6,), "b"), False)])

    reads = racing_reads(monkeypatch, store, late_delta)
    later_ms = int(time.time() * 1000) + 1000  # its 50 ms deadline past, as of then: no sleep for it
    assert await store.expire_overdue(await store.get(req.id), later_ms, 0.0, "gateway")
    assert reads == [1, 2]
    rec = await store.get(req.id)
    assert rec.state is Status.EXPIRED
    assert rec.result.output == {"text": "ab", "token_ids": [5, 6], "completion_tokens": 2, "prompt_tokens": 1}
    async with client.pubsub() as sub:
        await sub.subscribe(store.keys.done_channel(req.id))
        await sub.get_message(timeout=1.0)  # the subscription's confirmation
        await queue.publish_deltas([(req.id, StreamDelta(2, (7,), "c"), False)])  # the late worker's next step
        assert await sub.get_message(timeout=0.3) is None  # not sent to a follower
    assert await client.xlen(store.keys.events(req.id)) == 2  # nor kept for a resume


@pytest.mark.redis
async def test_an_expiry_racing_a_worker_that_keeps_writing_gives_way(parts, monkeypatch) -> None:  # noqa: F811
    """A worker that writes a delta between every read and write is alive: the expiry gives way after its tries
    (ends nothing, says so) and the request runs on to the end its worker writes."""
    from shared.records import UNANSWERED_TRIES

    client, _, store, queue = parts
    req = await queued(client, store, "req_busy")
    await store.start([req], int(time.time() * 1000))

    async def late_delta(n: int) -> None:
        await queue.publish_deltas([(req.id, StreamDelta(n - 1, (n,), "x"), n == 1)])

    reads = racing_reads(monkeypatch, store, late_delta)
    later_ms = int(time.time() * 1000) + 1000
    assert not await store.expire_overdue(await store.get(req.id), later_ms, 0.0, "gateway")
    assert reads == list(range(UNANSWERED_TRIES))
    assert (await store.get(req.id)).state is Status.RUNNING
