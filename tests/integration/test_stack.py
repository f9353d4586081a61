"""Gateway over HTTP + a real worker + real Redis + real models: the request lifecycle end to end."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shared.codec import decode
from shared.ids import new_request_id
from shared.keys import Keys
from shared.messages import ErrorInfo, RequestResult
from shared.states import FinishReason, Status
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]


async def wait_until(predicate, timeout: float = 10.0) -> None:
    """Test helper: re-check a condition about state the test does not own (bounded)."""
    end = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def tiny_llama_reference(loaded, prompt_ids: list[int], n: int) -> list[int]:
    model = loaded.model
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


async def test_embed_submit_then_long_poll(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"texts": ["hello", "world"]}})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["status"] == "queued" and body["id"].startswith("req_")
        assert r.headers["location"] == f"/v1/requests/{body['id']}"
        got = (await gw.client.get(f"/v1/requests/{body['id']}?wait=10")).json()
        assert got["status"] == "succeeded" and got["finish_reason"] == "done"
        vecs = torch.tensor(got["output"]["embeddings"])
        assert vecs.shape == (2, 384)
        assert torch.allclose(vecs.norm(dim=1), torch.ones(2), atol=1e-4)
        # the same vector sentence-transformers' recipe gives (mean pooling + L2 norm) on the real weights
        tok, model = loaded_models["minilm"].tokenizer, loaded_models["minilm"].model
        enc = tok(["hello"], return_tensors="pt")
        with torch.inference_mode():
            ref = model(**enc).last_hidden_state.mean(dim=1)
        assert torch.nn.functional.cosine_similarity(vecs[0:1], ref).item() > 0.9999
        assert got["timings"]["queue_ms"] >= 0 and got["timings"]["compute_ms"] > 0


async def test_generate_sync_wait_matches_generate(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    prompt = [5, 17, 300, 42, 7]
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=20", json={
            "input": {"input_ids": prompt}, "params": {"max_new_tokens": 32, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert out["token_ids"] == tiny_llama_reference(loaded_models["tiny-llama"], prompt, 32)
        assert out["completion_tokens"] == 32 and out["prompt_tokens"] == 5
        r = await gw.client.post("/v1/models/tiny-llama/requests", headers={"Prefer": "wait=20"}, json={
            "input": {"prompt": "Once upon a time"}, "params": {"max_new_tokens": 8}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded"
        assert isinstance(r.json()["output"]["text"], str)


async def test_the_built_in_llama_serves_a_2048_token_prompt_in_chunks_beside_a_running_row(redis_url, prefix,
                                                                                        loaded_models):
    """The built-in Llamas take prompts of up to 2,048 tokens: prefilled in chunks while other rows decode, with
    the tokens `generate` gives; one token more is refused at submit."""
    settings = make_settings(redis_url, prefix)
    spec = settings.model("tiny-llama")
    assert spec is not None and spec.max_input_tokens >= 2048 and spec.prefill_chunk_tokens < 2048
    long_prompt = [(i * 7919) % 8000 + 3 for i in range(2048)]
    short_prompt = [5, 17, 300, 42, 7]
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        params = {"max_new_tokens": 16, "ignore_eos": True}
        short = gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
            "input": {"input_ids": short_prompt}, "params": {"max_new_tokens": 64, "ignore_eos": True}})
        long = gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
            "input": {"input_ids": long_prompt}, "params": params})
        rs, rl = await asyncio.gather(short, long)
        assert rs.status_code == 200 and rl.status_code == 200, (rs.text, rl.text)
        assert rl.json()["output"]["prompt_tokens"] == 2048
        assert rl.json()["output"]["token_ids"] == tiny_llama_reference(loaded_models["tiny-llama"], long_prompt, 16)
        assert rs.json()["output"]["token_ids"] == tiny_llama_reference(loaded_models["tiny-llama"], short_prompt, 64)
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={
            "input": {"input_ids": [*long_prompt, 3]}, "params": params})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.input_ids", r.text


async def test_a_stop_string_ends_text_and_token_ids_before_it(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    tok = loaded_models["tiny-llama"].tokenizer
    prompt = [5, 17, 300, 42, 7]
    ref = tiny_llama_reference(loaded_models["tiny-llama"], prompt, 24)
    full = tok.decode(ref, skip_special_tokens=True)
    at = len(tok.decode(ref[:12], skip_special_tokens=True))
    stop = full[at:at + 3]
    assert len(stop) == 3, full  # the reference text goes on past its 12th token
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=20", json={
            "input": {"input_ids": prompt}, "params": {"max_new_tokens": 24, "ignore_eos": True, "stop": stop}})
        assert r.status_code == 200, r.text
        body = r.json()
    out, cut = body["output"], full.find(stop)
    assert body["finish_reason"] == "stop"
    assert out["text"] == full[:cut]
    ids = out["token_ids"]
    assert ids == ref[:len(ids)] and out["completion_tokens"] == len(ids)
    spelled = tok.decode(ids, skip_special_tokens=True)
    assert out["text"].startswith(spelled) and stop not in spelled
    # and no further: one more token would reach into the stop string
    assert not out["text"].startswith(tok.decode(ref[:len(ids) + 1], skip_special_tokens=True))


async def test_wait_shorter_than_compute_returns_202(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:  # no worker: nothing can finish
        t0 = time.monotonic()
        r = await gw.client.post("/v1/models/minilm/requests?wait=0.3", json={"input": {"text": "x"}})
        assert r.status_code == 202 and 0.25 < time.monotonic() - t0 < 3
        poll = await gw.client.get(f"/v1/requests/{r.json()['id']}")
        assert poll.status_code == 200 and poll.json()["status"] == "queued" and r.json()["status"] == "queued"
    # a wait that runs out while the request computes says it runs, as a poll then would
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"input_ids": list(range(3, 1500))}, "params": {"max_new_tokens": 256, "ignore_eos": True}}
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=0.5", json=body)
        assert r.status_code == 202 and r.json()["status"] == "running", r.text
        done = await gw.client.get(f"/v1/requests/{r.json()['id']}?wait=60")
        assert done.json()["status"] == "succeeded" and done.json()["timings"]["total_ms"] > 500, done.json()


async def test_cancel_queued_request_is_never_computed(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    keys = Keys(prefix)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"prompt": "hi"}})
        rid = r.json()["id"]
        d = await gw.client.delete(f"/v1/requests/{rid}")
        assert d.status_code == 200 and d.json()["status"] == "cancelled"
        again = await gw.client.delete(f"/v1/requests/{rid}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_finished"
        async with running_worker(settings, loaded_models) as w:
            async def drained() -> bool:
                return sum([await gw.service.redis.xlen(s) for s in keys.lane_streams("tiny-llama", (
                    "short", "medium", "long"))]) == 0
            await wait_until(drained)
            assert rid not in w.model_calls("tiny-llama")
        final = (await gw.client.get(f"/v1/requests/{rid}")).json()
        assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled"


async def test_cancel_running_generation_stops_it(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models) as w, running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={
            "input": {"input_ids": list(range(1, 300))}, "params": {"max_new_tokens": 256, "ignore_eos": True}})
        rid = r.json()["id"]
        runner = w.worker.engines["tiny-llama"].for_lane("long").runner  # 299 + 256 tokens: the long lane

        async def running() -> bool:
            return rid in runner.running_ids()
        await wait_until(running)
        d = await gw.client.delete(f"/v1/requests/{rid}")
        assert d.status_code == 200 and d.json()["status"] == "cancelled"
        # the worker stopped it and answered with what it had generated (the prompt may still be prefilling)
        out = d.json()["output"]
        assert d.json()["finish_reason"] == "cancelled" and d.json()["error"]["message"] == "cancelled while running"
        assert out is not None and out["completion_tokens"] == len(out["token_ids"]) < 256, out

        async def stopped() -> bool:
            return rid not in runner.running_ids() and rid not in w.worker.held
        await wait_until(stopped, timeout=5)
        assert (await gw.client.get(f"/v1/requests/{rid}")).json()["status"] == "cancelled"
        late = await gw.client.delete(f"/v1/requests/{rid}")
        assert late.status_code == 409


async def test_cancel_after_success_is_a_conflict(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests?wait=10", json={"input": {"text": "x"}})
        assert r.status_code == 200
        d = await gw.client.delete(f"/v1/requests/{r.json()['id']}")
        assert d.status_code == 409 and d.json()["error"]["code"] == "already_finished"


async def test_result_ready_before_the_waiter_subscribes(redis_url, prefix):
    """The subscribe-vs-publish race: a result written before the wait starts is returned at once."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})
        rid = r.json()["id"]
        won = await gw.service.store.finish(RequestResult(id=rid, status=Status.SUCCEEDED,
                                                          output={"embeddings": [[1.0]]},
                                                          finish_reason=FinishReason.DONE, finished_ms=1))
        assert won
        t0 = time.monotonic()
        got = await gw.client.get(f"/v1/requests/{rid}?wait=10")
        assert got.json()["status"] == "succeeded" and time.monotonic() - t0 < 1.0


async def test_result_published_while_waiting_wakes_the_waiter(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        rid = (await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})).json()["id"]
        waiters = [asyncio.create_task(gw.client.get(f"/v1/requests/{rid}?wait=20")) for _ in range(5)]
        await wait_until(lambda: _true(gw.service.hub.waiting >= 5))
        t0 = time.monotonic()
        await gw.service.store.finish(RequestResult(id=rid, status=Status.FAILED, finished_ms=1,
                                                    error=ErrorInfo("x", "y")))
        for resp in await asyncio.gather(*waiters):
            assert resp.json()["status"] == "failed"
        assert time.monotonic() - t0 < 1.0


async def _true(value: bool) -> bool:
    return value


async def test_first_terminal_write_wins(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        rid = (await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})).json()["id"]
        store = gw.service.store
        first = RequestResult(id=rid, status=Status.SUCCEEDED, output={"a": 1}, finished_ms=1)
        second = RequestResult(id=rid, status=Status.FAILED, error=ErrorInfo("late", "late"), finished_ms=2)
        assert await store.finish(first) is True
        assert await store.finish(second) is False
        raw = await gw.service.redis.hget(Keys(prefix).record(rid), "result")
        assert decode(raw, RequestResult) == first


async def test_deadline_passed_in_queue_expires_without_compute(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={"input": {"prompt": "x"}, "timeout_s": 0.05})
        rid = r.json()["id"]
        await asyncio.sleep(0.1)
        async with running_worker(settings, loaded_models) as w:
            got = (await gw.client.get(f"/v1/requests/{rid}?wait=10")).json()
            assert got["status"] == "expired" and got["error"]["code"] == "deadline_exceeded"
            assert rid not in w.model_calls("tiny-llama")


async def test_no_worker_request_expires_visibly_after_deadline(redis_url, prefix):
    settings = make_settings(redis_url, prefix, expiry_grace_s=0.2)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}, "timeout_s": 0.3})
        t0 = time.monotonic()
        got = (await gw.client.get(f"/v1/requests/{r.json()['id']}?wait=30")).json()
        assert got["status"] == "expired" and time.monotonic() - t0 < 3


async def test_fifty_mixed_requests_all_succeed_and_match_the_reference(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    loaded = loaded_models["tiny-llama"]
    prompts = [[(7 * i + j) % 8000 + 3 for j in range(4 + (i * 13) % 60)] for i in range(50)]
    lengths = [4 + (i * 7) % 29 for i in range(50)]
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        async def one(i: int):
            r = await gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
                "input": {"input_ids": prompts[i]}, "params": {"max_new_tokens": lengths[i], "ignore_eos": True}})
            return r
        responses = await asyncio.gather(*(one(i) for i in range(50)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    for i, r in enumerate(responses):
        assert r.json()["output"]["token_ids"] == tiny_llama_reference(loaded, prompts[i], lengths[i]), i


async def test_models_health_and_metrics(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        await gw.client.post("/v1/models/minilm/requests?wait=10", json={"input": {"text": "x"}})
        models = (await gw.client.get("/v1/models")).json()["models"]
        assert {m["name"] for m in models} == {"minilm", "tiny-llama"}
        assert all("backlog" in lane for m in models for lane in m["lanes"])
        assert (await gw.client.get("/healthz")).status_code == 200
        assert (await gw.client.get("/readyz")).json() == {"status": "ready"}
        text = (await gw.client.get("/metrics")).text
        assert "batchgate_backlog{" in text and "batchgate_submitted_total{" in text


BAD_SUBMITS = [
    ("/v1/models/nope/requests", b'{"input": {"text": "x"}}', {}, 404),
    ("/v1/models/minilm/requests", b"{not json", {}, 400),
    ("/v1/models/tiny-llama/requests", b'{"input": {"prompt": "x"}, "params": {"temperature": NaN}}', {}, 400),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "timeout_s": Infinity}', {}, 400),
    ("/v1/models/minilm/requests", b"", {}, 400),
    ("/v1/models/minilm/requests", b"[1, 2]", {}, 422),
    ("/v1/models/minilm/requests", b'"text"', {}, 422),
    ("/v1/models/minilm/requests", b"{}", {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"texts": [1]}}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "extra": 1}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "timeout_s": -1}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "timeout_s": "soon"}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "deadline": 1}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "deadline": "tomorrow"}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "priority": "urgent"}', {}, 422),
    ("/v1/models/tiny-llama/requests", b'{"input": {"prompt": "x"}, "params": {"max_new_tokens": 100000}}', {}, 422),
    ("/v1/models/tiny-llama/requests", b'{"input": {"prompt": "x"}, "params": {"temperature": "hot"}}', {}, 422),
    ("/v1/models/tiny-llama/requests", b'{"input": {"texts": ["x"]}}', {}, 422),
    ("/v1/models/minilm/requests?wait=abc", b'{"input": {"text": "x"}}', {}, 400),
    ("/v1/models/minilm/requests?wait=-1", b'{"input": {"text": "x"}}', {}, 400),
    ("/v1/models/minilm/requests", b"\xff\xfe", {}, 400),
    ("/v1/models/minilm/requests", b"<xml/>", {"content-type": "application/xml"}, 415),
    ("/v1/models/minilm/requests", b"\xc1", {"content-type": "application/msgpack"}, 400),
    ("/v1/models/minilm/requests", b'{"input": {"text": "' + b"x" * (2 << 20) + b'"}}', {}, 413),
    ("/v1/models/minilm/requests", b"[" * 100_000, {}, 400),  # nested past any recursion limit
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "timeout_s": 1' + b"0" * 400 + b"}", {}, 422),
    ("/v1/models/tiny-llama/requests", b'{"input": {"prompt": "x"}, "params": {"temperature": 1' + b"0" * 400 + b"}}",
     {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "deadline": 9' + b"9" * 400 + b"}", {}, 422),
    ("/v1/models/minilm/requests", b"\x81\xc4\x01k\x01", {"content-type": "application/msgpack"}, 400),  # bytes key
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "callback": {"url": "http://a\\u0000b.example/"}}',
     {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "callback": {"url": "https://x.example/\\u0001"}}',
     {}, 422),
    ("/v1/models/minilm/requests:batch", b'{"requests": [1, 2]}', {}, 422),
    # issue 17: the header spelling of wait is checked like the query's; only JSON and msgpack are read
    # (a text/plain or form body is what any web page may post cross-site); a timeout nothing can meet
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"prefer": "wait=abc"}, 400),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"prefer": "respond-async, wait=-3"}, 400),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"content-type": "text/plain"}, 415),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}',
     {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"content-type": "multipart/form-data"}, 415),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "timeout_s": 0.001}', {}, 422),
    ("/v1/models/minilm/requests", b'{"input": {"text": "\\ud800"}}', {}, 422),
    ("/v1/models/minilm/requests:batch", b'{"requests": [{"input": {"text": "x"}}]}', {"content-type": "text/plain"},
     415),
    # a compressed body this gateway cannot read: 415, not a JSON error; a callback no request can reach
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"content-encoding": "gzip"}, 415),
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}, "callback": {"url": "http://exa mple.com/"}}', {}, 422),
    # no content type at all: what a browser sends for an untyped body (a Blob) cross-site, without a preflight
    ("/v1/models/minilm/requests", b'{"input": {"text": "x"}}', {"content-type": None}, 415),
    ("/v1/chat/completions", b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}',
     {"content-type": None}, 415),
]


@pytest.mark.parametrize(("path", "body", "headers", "status"), BAD_SUBMITS)
async def test_bad_input_gets_a_clear_4xx(redis_url, prefix, path, body, headers, status):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        sent = {k: v for k, v in {"content-type": "application/json", **headers}.items() if v is not None}
        r = await gw.client.post(path, content=body, headers=sent)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] and err["message"]
        # nothing was queued for a refused request
        assert sum((await gw.service.backlog("minilm", ("short", "long"))).values()) == 0


async def test_unknown_ids_routes_and_methods(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        for path in ("/v1/requests/" + new_request_id(), "/v1/requests/../../etc", "/v1/requests/x"):
            r = await gw.client.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] in ("request_not_found", "not_found")
        assert (await gw.client.delete("/v1/requests/" + new_request_id())).status_code == 404
        gone = await gw.client.get("/v1/requests/req_aaaaaaaaaaaaaaaaaaaaaaaaaa")  # a well-formed id from 1970
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "result_expired"
        assert (await gw.client.get("/nope")).status_code == 404
        r = await gw.client.put("/v1/models")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        # every 405 says what is allowed (issue 17), the paths with two methods included
        assert set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
        r = await gw.client.post("/v1/requests/" + new_request_id())
        assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD", "DELETE"}
        for method, path in (("PUT", "/metrics"), ("DELETE", "/openapi.json"), ("GET", "/v1/models/minilm/requests")):
            r = await gw.client.request(method, path)
            assert r.status_code == 405 and r.headers["allow"] and r.json()["error"]["code"] == "method_not_allowed"


async def test_garbage_msgpack_says_what_is_wrong(redis_url, prefix):
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        for raw, words in ((b"\xc1", "begins no msgpack value"), (b"\x92\x01", "ends in the middle"),
                           (b"not msgpack", "more than one msgpack value")):
            r = await gw.client.post("/v1/models/minilm/requests", content=raw,
                                     headers={"content-type": "application/msgpack"})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


async def test_msgpack_in_and_out(redis_url, prefix, loaded_models):
    import msgpack

    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests?wait=10",
                                 content=msgpack.packb({"input": {"text": "hello"}}),
                                 headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
        assert msgpack.unpackb(r.content)["status"] == "succeeded"


async def test_a_flood_beyond_the_kv_budget_waits_instead_of_failing(redis_url, prefix, loaded_models):
    """Admission within the memory budget: the running batch never outgrows its rows; the rest waits."""
    import dataclasses

    from shared.config import BUILTIN_MODELS

    spec = dataclasses.replace(BUILTIN_MODELS["tiny-llama"], max_running=4, max_batch_size=4)
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_worker(settings, loaded_models) as w, running_gateway(settings) as gw:
        engine = w.worker.engines["tiny-llama"].for_lane("short").runner.engine  # type: ignore[attr-defined]
        responses = await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
            "input": {"input_ids": [3 + i, 4, 5]}, "params": {"max_new_tokens": 16}}) for i in range(40)))
        assert all(r.status_code == 200 and r.json()["status"] == "succeeded" for r in responses)
        assert engine.max_rows == 4 and engine.cache.rows_cap <= 4


async def test_worker_metrics_after_generation(redis_url, prefix, loaded_models):
    from prometheus_client import generate_latest

    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=20", json={
            "input": {"input_ids": [5, 6, 7, 8]}, "params": {"max_new_tokens": 24, "ignore_eos": True}})
            for _ in range(6)))
        await asyncio.sleep(1.2)  # the compute loop refreshes its gauges once a second
        text = generate_latest().decode()
    for name in ("batchgate_running_sequences", "batchgate_tokens_per_second", "batchgate_ttft_seconds_bucket",
                 "batchgate_kv_padding_fraction", 'batchgate_engine_seconds_total{model="tiny-llama",phase="prefill"}',
                 'phase="decode"', "batchgate_batch_size_bucket", "batchgate_queue_wait_seconds_bucket",
                 "batchgate_compute_seconds_bucket", 'batchgate_results_total{model="tiny-llama",status="succeeded"}',
                 "batchgate_worker_backlog"):
        assert name in text, name


async def test_an_expired_result_reads_410(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, result_ttl_s=1)
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests?wait=10", json={"input": {"text": "x"}})
        assert r.status_code == 200
        await asyncio.sleep(1.6)  # longer than the result TTL
        gone = await gw.client.get(f"/v1/requests/{r.json()['id']}?wait=5")
        assert gone.status_code == 410 and gone.json()["error"]["code"] == "result_expired"
