"""Token streaming end to end: a real gateway and worker on real Redis, read as Server-Sent Events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
import torch

from shared.codec import encode
from shared.keys import Keys
from shared.messages import StreamDelta
from tests.redis_cluster import delete_prefix
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

PROMPT = "the quick brown fox jumps over the lazy dog"


async def read_events(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    """The SSE events of a streamed response: {id, event, data}; stops after `limit` events."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if current:
                events.append(current)
                current = {}
                if (limit is not None and len(events) >= limit) or events[-1]["event"] == "done":
                    break
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        current[name] = json.loads(value) if name == "data" else value
    return events


async def events_of(client: httpx.AsyncClient, request_id: str, last_id: str | None = None,
                    limit: int | None = None) -> list[dict[str, Any]]:
    headers = {"Last-Event-ID": last_id} if last_id is not None else {}
    async with client.stream("GET", f"/v1/requests/{request_id}/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return await read_events(r, limit)


def deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["event"] == "delta"]


def check_adds_up(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas are contiguous, each id the token count so far, and they concatenate to the final output."""
    done = events[-1]
    assert done["event"] == "done", events[-3:]
    out = done["data"]["output"]
    ds = deltas(events)
    assert "".join(d["text"] for d in ds) == out["text"]
    assert [t for d in ds for t in d["token_ids"]] == out["token_ids"]
    at = 0
    for e in events:
        if e["event"] == "delta":
            assert e["data"]["index"] == at
            at += len(e["data"]["token_ids"])
            assert e["id"] == str(at)
    return done["data"]


def reference(loaded, prompt_ids: list[int], n: int) -> list[int]:
    out = loaded.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


async def test_a_streamed_generation_arrives_token_by_token_and_adds_up(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 24, "ignore_eos": True}, "stream": True}
        r = await gw.client.post("/v1/models/tiny-llama/requests", json=body)
        assert r.status_code == 202, r.text
        rid = r.json()["id"]
        events = await events_of(gw.client, rid)
        assert events[0]["event"] == "status" and events[0]["data"]["status"] in ("queued", "running")
        final = check_adds_up(events)
        assert final["status"] == "succeeded" and len(final["output"]["token_ids"]) == 24
        assert len(deltas(events)) >= 8  # published as decoded, not once at the end
        ids = loaded_models["tiny-llama"].tokenizer(PROMPT)["input_ids"]
        assert final["output"]["token_ids"] == reference(loaded_models["tiny-llama"], ids, 24)
        # a finished stream read again gives the same events' content
        again = await events_of(gw.client, rid)
        assert check_adds_up(again) == final


async def test_submit_with_accept_event_stream_answers_with_the_stream(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 12}, "stream": True}
        async with gw.client.stream("POST", "/v1/models/tiny-llama/requests", json=body,
                                    headers={"Accept": "text/event-stream"}) as r:
            assert r.status_code == 200 and r.headers["location"].startswith("/v1/requests/req_")
            events = await read_events(r)
        assert check_adds_up(events)["status"] == "succeeded"
        # an invalid streaming submit is still a plain JSON error
        bad = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {}, "stream": True},
                                   headers={"Accept": "text/event-stream"})
        assert bad.status_code == 422 and bad.json()["error"]["code"]
        # embeddings do not stream
        emb = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}, "stream": True})
        assert emb.status_code == 422 and "stream" in emb.text


async def test_reconnecting_with_last_event_id_loses_and_repeats_nothing(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 40, "ignore_eos": True}, "stream": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]
        seen: list[dict[str, Any]] = []
        last = None
        for _ in range(30):  # drop the connection after every third event, reconnect where it left off
            part = await events_of(gw.client, rid, last_id=last, limit=3)
            seen.extend(e for e in part if e["event"] != "status")
            last = part[-1]["id"]
            if part[-1]["event"] == "done":
                break
        final = check_adds_up(seen)
        assert final["status"] == "succeeded" and len(final["output"]["token_ids"]) == 40
        # the finished request's stream again: the same deltas and `done`, as a request that did not stream gets
        # them (no "running" status: it no longer runs)
        replay = await events_of(gw.client, rid)
        assert {e["event"] for e in replay} == {"delta", "done"} and check_adds_up(replay) == final
        bad = await gw.client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": "x1"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_last_event_id"
        # an id past the output was never sent: refused, not answered with `done` under that id
        past = await gw.client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": "41"})
        assert past.status_code == 400 and past.json()["error"]["code"] == "invalid_last_event_id", past.text
        assert "at most 40" in past.json()["error"]["message"]
        assert [e["event"] for e in await events_of(gw.client, rid, last_id="40")] == ["done"]  # the last id sent


async def test_a_resumed_streams_status_event_keeps_the_callers_place(redis_url, prefix, loaded_models):
    """A reconnect opens with a status event: its id is where the caller is, so a client that drops right after it
    (an EventSource keeps the last id it saw) resumes there, not from the first token again."""
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 256, "ignore_eos": True}, "stream": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]
        first = [e for e in await events_of(gw.client, rid, limit=4) if e["event"] == "delta"]
        assert first, "no delta among the first events"
        have = first[-1]["id"]
        (opening,) = await events_of(gw.client, rid, last_id=have, limit=1)
        assert opening["event"] == "status" and opening["id"] == have, opening
        rest = await events_of(gw.client, rid, last_id=opening["id"])
        final = check_adds_up([*first, *rest])  # nothing repeated, nothing lost
        assert final["status"] == "succeeded" and len(final["output"]["token_ids"]) == 256


async def test_a_stop_string_never_leaks_into_the_stream(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        # find a piece of text the model will produce, and make it the stop string
        probe = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 30, "ignore_eos": True}}
        text = (await gw.client.post("/v1/models/tiny-llama/requests?wait=30", json=probe)).json()["output"]["text"]
        stop = text[len(text) // 2:len(text) // 2 + 4]
        assert len(stop) == 4
        body = {**probe, "params": {**probe["params"], "stop": [stop]}, "stream": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]
        events = await events_of(gw.client, rid)
        final = check_adds_up(events)
        assert final["finish_reason"] == "stop" and stop not in final["output"]["text"], (text, stop, final)
        assert all(stop not in d["text"] for d in deltas(events))
        assert text.startswith(final["output"]["text"])
        # vLLM's include_stop_str_in_output: the stop string comes last, in the deltas as in the result
        body["params"] = {**body["params"], "include_stop_str_in_output": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]
        events = await events_of(gw.client, rid)
        kept = check_adds_up(events)
        assert kept["output"]["text"] == final["output"]["text"] + stop, (text, stop, kept)
        assert "".join(d["text"] for d in deltas(events)).endswith(stop) and text.startswith(kept["output"]["text"])


async def test_cancel_and_deadline_end_the_stream_with_a_terminal_event(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 256, "ignore_eos": True}, "stream": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]

        async def cancel_soon() -> None:
            await asyncio.sleep(0.5)
            await gw.client.delete(f"/v1/requests/{rid}")

        task = asyncio.create_task(cancel_soon())
        events = await events_of(gw.client, rid)
        await task
        assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "cancelled"
        # cancelled while it ran: its worker stopped it and kept what it had generated, so what the caller was
        # sent adds up to the final output, as for any other end
        done = check_adds_up(events)
        assert 0 < done["output"]["completion_tokens"] < 256 and deltas(events), done
        # a request whose deadline passes while nothing computes it: the stream still ends
        try:
            async with running_gateway(make_settings(redis_url, prefix + "-idle")) as idle:
                short = {"input": {"prompt": "hi"}, "stream": True, "timeout_s": 1}
                rid2 = (await idle.client.post("/v1/models/tiny-llama/requests", json=short)).json()["id"]
                events = await events_of(idle.client, rid2)
                assert events[-1]["event"] == "done" and events[-1]["data"]["status"] == "expired"
        finally:  # a prefix of this test's own, besides the fixture's: its keys go too
            delete_prefix(redis_url, prefix + "-idle")


async def test_a_request_that_did_not_stream_gets_its_output_as_one_delta(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=30",
                                 json={"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 8}})
        events = await events_of(gw.client, r.json()["id"])
        assert [e["event"] for e in events] == ["delta", "done"]
        check_adds_up(events)
        emb = await gw.client.post("/v1/models/minilm/requests?wait=30", json={"input": {"text": "x"}})
        assert [e["event"] for e in await events_of(gw.client, emb.json()["id"])] == ["done"]


async def test_a_request_run_again_continues_after_what_its_caller_was_sent(redis_url, prefix, loaded_models):
    """As after a worker crash mid-stream: an earlier attempt sent some tokens; the next attempt continues
    after them instead of generating them again, so the caller sees each token once and the output holds
    the sent ones whatever the next attempt would have sampled."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        body = {"input": {"prompt": PROMPT}, "params": {"max_new_tokens": 16, "ignore_eos": True}, "stream": True}
        rid = (await gw.client.post("/v1/models/tiny-llama/requests", json=body)).json()["id"]
        sent = (11, 12, 13)  # not what the model would generate: the continuation must keep them anyway
        tok = loaded_models["tiny-llama"].tokenizer
        redis = gw.service.redis
        await redis.xadd(Keys(prefix).events(rid), {"d": encode(StreamDelta(0, sent, tok.decode(list(sent))))})
        async with running_worker(settings, loaded_models):
            events = await events_of(gw.client, rid)
    final = check_adds_up(events)
    out = final["output"]["token_ids"]
    assert tuple(out[:3]) == sent and len(out) == 16
    ids = tok(PROMPT)["input_ids"]
    assert out[3:] == reference(loaded_models["tiny-llama"], ids + list(sent), 13)


async def test_a_status_event_comes_first_and_never_between_deltas(redis_url, prefix):
    """Every stream opens with the request's status and announces `running` before the first delta: read from
    the submit, and joined while the request is already running (before: deltas first, `running` between them,
    `queued` missing). The echo model's steps take a known time."""
    from shared.config import ModelSpec
    from shared.states import Task

    echo = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64,
                     max_new_tokens=200, step_ms=10).validate()
    settings = make_settings(redis_url, prefix, models=(echo,))
    body = {"input": {"prompt": "ab"}, "params": {"max_new_tokens": 120}, "stream": True}

    def check(events: list[dict[str, Any]], first: str) -> None:
        names = [e["event"] for e in events]
        assert names[0] == "status" and events[0]["data"]["status"] == first, names[:4]
        first_delta = names.index("delta")
        statuses = [e["data"]["status"] for e in events if e["event"] == "status"]
        assert statuses[-1] == "running" and "status" not in names[first_delta:], names
        assert check_adds_up(events)["status"] == "succeeded"

    async with running_worker(settings, {}), running_gateway(settings) as gw:
        for _ in range(3):
            async with gw.client.stream("POST", "/v1/models/echo/requests", json=body,
                                        headers={"Accept": "text/event-stream"}) as r:
                check(await read_events(r), "queued")
            rid = (await gw.client.post("/v1/models/echo/requests", json=body)).json()["id"]
            async with gw.client.stream("GET", f"/v1/requests/{rid}/events") as first:
                async for line in first.aiter_lines():  # until its first tokens are out
                    if line == "event: delta":
                        break
            check(await events_of(gw.client, rid), "running")  # joined mid-run


async def test_a_stream_announces_running_when_its_worker_starts_it_not_with_its_first_tokens(redis_url, prefix):
    """A streaming request whose text is held back (the output so far always begins its stop string) releases no
    token until its end: its stream says `running` when a worker starts it, ~0.6 s before its one delta (it said
    `queued` to the end; so did a long prefill until its first token), as GET would have said."""
    import time

    from shared.config import ModelSpec
    from shared.states import Task

    echo = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64,
                     max_new_tokens=200, step_ms=10).validate()
    settings = make_settings(redis_url, prefix, models=(echo,))
    body = {"input": {"prompt": "ab"}, "params": {"max_new_tokens": 60, "stop": ["ab" * 31 + "X"]}, "stream": True}
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        async with gw.client.stream("POST", "/v1/models/echo/requests", json=body,
                                    headers={"Accept": "text/event-stream"}) as r:
            timed: list[tuple[float, str]] = []
            async for line in r.aiter_lines():
                if line.startswith("data:") and '"status"' in line and '"running"' in line:
                    timed.append((time.monotonic(), "running"))
                elif line == "event: delta":
                    timed.append((time.monotonic(), "delta"))
                elif line == "event: done":
                    break
        assert [name for _, name in timed] == ["running", "delta"], timed
        assert timed[1][0] - timed[0][0] > 0.3, timed  # announced as it started, not with the output


async def test_an_event_source_client_gets_events_without_asking_for_stream(redis_url, prefix):
    """`Accept: text/event-stream` alone (an EventSource client) answers the submit with its events, the
    output as one delta before `done`; a client that prefers JSON, or refuses events, gets the 202."""
    from shared.config import ModelSpec
    from shared.states import Task

    echo = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64,
                     max_new_tokens=64).validate()
    settings = make_settings(redis_url, prefix, models=(echo,))
    body = {"input": {"prompt": "abc"}, "params": {"max_new_tokens": 5}}
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        async with gw.client.stream("POST", "/v1/models/echo/requests", json=body,
                                    headers={"Accept": "text/event-stream"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = await read_events(r)
        assert check_adds_up(events)["output"]["text"] == "abcab" and len(deltas(events)) == 1
        for accept in ("application/json, text/event-stream", "text/event-stream;q=0, application/json"):
            r = await gw.client.post("/v1/models/echo/requests", json={**body, "stream": True},
                                     headers={"Accept": accept})
            assert (r.status_code == 202) == (accept.startswith("text/event-stream;q=0")), (accept, r.status_code)


async def test_a_streamed_submit_opens_with_queued_though_its_worker_started_it_before_the_gateway_read_it(
        redis_url, prefix, monkeypatch):
    """The streamed submit reads the record after storing it; a worker that starts the request in between made the
    stream open with `running` (CI, on a loaded Redis Cluster): it opens with what the submit answered, `queued`, and
    announces `running` before the first delta."""
    from shared import operations as ops
    from shared.config import ModelSpec
    from shared.states import Status, Task

    echo = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64,
                     max_new_tokens=200, step_ms=10).validate()
    settings = make_settings(redis_url, prefix, models=(echo,))
    real_visible = ops.visible

    async def started_meanwhile(q, tenant, request_id):
        rec = await real_visible(q, tenant, request_id)
        return rec if rec.terminal else dataclasses.replace(rec, state=Status.RUNNING)

    monkeypatch.setattr(ops, "visible", started_meanwhile)
    body = {"input": {"prompt": "ab"}, "params": {"max_new_tokens": 20}, "stream": True}
    async with running_worker(settings, {}), running_gateway(settings) as gw, \
            gw.client.stream("POST", "/v1/models/echo/requests", json=body,
                             headers={"Accept": "text/event-stream"}) as r:
        events = await read_events(r)
    names = [e["event"] for e in events]
    assert names[0] == "status" and events[0]["data"]["status"] == "queued", names[:4]
    statuses = [e["data"]["status"] for e in events if e["event"] == "status"]
    assert statuses[-1] == "running" and "status" not in names[names.index("delta"):], names
