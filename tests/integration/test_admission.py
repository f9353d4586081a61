"""Lanes, deadlines and admission through the real stack (gateway over HTTP, Redis, worker)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from shared.admission import serving
from shared.config import BUILTIN_MODELS
from shared.lanes import LaneSpec
from tests.integration.test_stack import wait_until
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

LLAMA = BUILTIN_MODELS["tiny-llama"]


async def warm_stats(gw, n: int = 6) -> None:
    """Run a few requests so the worker has measured its service times, then wait for fresh stats."""
    await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=30", json={
        "input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 32, "ignore_eos": True}})
        for _ in range(n)))

    async def measured() -> bool:
        _, stats = await gw.service.load("tiny-llama", "short")
        return any(s.decode_ms_per_step > 0 for s in serving(stats, "short"))
    await wait_until(measured, timeout=10)


async def test_infeasible_deadline_gets_429_with_retry_after(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, models=(LLAMA,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        await warm_stats(gw)
        r = await gw.client.post("/v1/models/tiny-llama/requests", json={
            "input": {"input_ids": list(range(3, 300))}, "params": {"max_new_tokens": 256, "ignore_eos": True},
            "timeout_s": 0.01})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "deadline_infeasible"
        assert "ms" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        ok = await gw.client.post("/v1/models/tiny-llama/requests", json={
            "input": {"input_ids": [5, 6]}, "params": {"max_new_tokens": 8}, "timeout_s": 30})
        assert ok.status_code == 202
        assert isinstance(ok.json()["eta_ms"], int) and "admission" not in ok.json()


async def test_a_burst_after_light_traffic_does_not_refuse_what_the_free_rows_can_serve(redis_url, prefix,
                                                                                         loaded_models):
    """After light traffic the measured completion rate is that traffic's arrivals (a few a second), not what the
    rows can do: a burst of 12 small requests, all fitting the free rows, was estimated to drain in seconds, and
    a request behind it with a 2 s deadline refused. The rows start them at once, so it is admitted and served."""
    settings = make_settings(redis_url, prefix, models=(LLAMA,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        await warm_stats(gw)
        small = {"input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 2, "ignore_eos": True}}
        burst = await gw.client.post("/v1/models/tiny-llama/requests:batch", json={"requests": [small] * 12})
        assert burst.status_code == 200, burst.text
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=10", json={**small, "timeout_s": 2.0})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "succeeded"


async def test_without_worker_stats_accept_up_to_the_backlog_cap(redis_url, prefix):
    spec = dataclasses.replace(LLAMA, lanes=(LaneSpec("all", None, 10.0, max_backlog=3),))
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_gateway(settings) as gw:
        body = {"input": {"prompt": "x"}, "timeout_s": 0.5}
        for _ in range(3):
            r = await gw.client.post("/v1/models/tiny-llama/requests", json=body)
            assert r.status_code == 202 and r.json()["eta_ms"] is None and "admission" in r.json()
        r = await gw.client.post("/v1/models/tiny-llama/requests", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "backlog_full"
        assert r.headers["retry-after"]


async def test_models_endpoint_shows_lane_load(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, models=(LLAMA,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        await warm_stats(gw)
        (model,) = (await gw.client.get("/v1/models")).json()["models"]
        assert model["workers"] == 1
        short = next(lane for lane in model["lanes"] if lane["name"] == "short")
        assert {"backlog", "running", "service_rate_rps", "est_wait_ms"} <= set(short)
        assert short["est_wait_ms"] is not None


async def test_interactive_requests_start_before_queued_batch_ones(redis_url, prefix, loaded_models):
    spec = dataclasses.replace(LLAMA, max_running=1, max_batch_size=1)
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_gateway(settings) as gw:
        ids = {}
        for i, prio in enumerate(["batch", "batch", "batch", "interactive", "interactive"]):
            r = await gw.client.post("/v1/models/tiny-llama/requests", json={
                "input": {"input_ids": [5 + i]}, "params": {"max_new_tokens": 4}, "priority": prio})
            ids[r.json()["id"]] = prio
        async with running_worker(settings, loaded_models):
            recs = [(await gw.client.get(f"/v1/requests/{rid}?wait=30")).json() for rid in ids]
    order = [ids[r["id"]] for r in sorted(recs, key=lambda r: r["started_at"])]
    assert order == ["interactive", "interactive", "batch", "batch", "batch"]


async def test_short_requests_are_not_stuck_behind_a_long_flood(redis_url, prefix, loaded_models):
    spec = dataclasses.replace(LLAMA, max_batch_tokens=2048)
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        long_body = {"input": {"input_ids": list(range(3, 300))}, "params": {"max_new_tokens": 80, "ignore_eos": True}}
        longs = [asyncio.create_task(gw.client.post("/v1/models/tiny-llama/requests?wait=60", json=long_body))
                 for _ in range(40)]
        await asyncio.sleep(0.05)
        shorts = await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
            "input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 4}}) for _ in range(5)))
        long_done = await asyncio.gather(*longs)
    assert all(r.status_code == 200 for r in [*shorts, *long_done])
    short_queue = [r.json()["timings"]["queue_ms"] for r in shorts]
    long_finish = sorted(r.json()["finished_at"] for r in long_done)
    assert all(r.json()["lane"] == "short" for r in shorts)
    # short requests went ahead of the queued long ones: each started within a few windows + one prefill
    assert max(short_queue) < 1000, short_queue
    assert max(r.json()["finished_at"] for r in shorts) < long_finish[len(long_finish) // 2]


async def test_a_lane_share_keeps_rows_for_short_work_when_long_work_fills_the_batch(redis_url, prefix,
                                                                                      loaded_models):
    # 4 rows; long work may hold half of them. Without the share, the 8 long requests would take every
    # row for their whole generation and the short ones would queue behind them.
    lanes = (LaneSpec("short", 64, 5.0), LaneSpec("long", None, 5.0, max_share=0.5))
    spec = dataclasses.replace(LLAMA, max_running=4, max_batch_tokens=4096, lanes=lanes)
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        long_body = {"input": {"input_ids": list(range(3, 200))},
                     "params": {"max_new_tokens": 160, "ignore_eos": True}}
        longs = [asyncio.create_task(gw.client.post("/v1/models/tiny-llama/requests?wait=120", json=long_body))
                 for _ in range(8)]

        async def two_longs_running() -> bool:
            (model,) = (await gw.client.get("/v1/models")).json()["models"]
            return next(ln for ln in model["lanes"] if ln["name"] == "long")["running"] == 2
        await wait_until(two_longs_running, timeout=30)
        shorts = await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=60", json={
            "input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 4, "ignore_eos": True}})
            for _ in range(2)))
        long_done = await asyncio.gather(*longs)
    assert all(r.status_code == 200 for r in [*shorts, *long_done])
    assert {r.json()["lane"] for r in long_done} == {"long"}
    # the short requests found free rows at once: they were done before any long request that was
    # running when they started had finished
    started = min(r.json()["started_at"] for r in shorts)
    running_then = [r.json()["finished_at"] for r in long_done
                    if r.json()["started_at"] <= started < r.json()["finished_at"]]
    assert running_then, "the short requests arrived between two waves of long work"
    assert max(r.json()["finished_at"] for r in shorts) < min(running_then)
    assert max(r.json()["timings"]["queue_ms"] for r in shorts) < 1000
    # and long work never held more than its two rows: the 8 ran in (at least) 4 waves
    starts = sorted(r.json()["started_at"] for r in long_done)
    assert starts[2] >= min(r.json()["finished_at"] for r in long_done) - 0.05


def most_at_once(results: list[dict]) -> int:
    """The most of these requests that were running at one moment (from their started and finished times)."""
    edges = sorted([(r["started_at"], 1) for r in results] + [(r["finished_at"], -1) for r in results],
                   key=lambda e: (e[0], e[1]))  # a row that finishes as another starts frees it first
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize(("long_rows", "bounded"), [(2, True), (0, False)])
async def test_longer_lanes_hold_long_rows_beside_short_work_until_their_queue_backs_up(
        redis_url, prefix, loaded_models, long_rows, bounded):
    """Six medium requests at once: held to `long_rows` = 2, they run two at a time (in waves shorter than the
    4 s after which a backed-up queue takes the free rows); with `long_rows: 0` (the default), all together."""
    spec = dataclasses.replace(LLAMA, long_rows=long_rows, max_batch_tokens=4096)
    settings = make_settings(redis_url, prefix, models=(spec,))
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        body = {"input": {"input_ids": list(range(3, 200))}, "params": {"max_new_tokens": 24, "ignore_eos": True}}
        done = await asyncio.gather(*(gw.client.post("/v1/models/tiny-llama/requests?wait=60", json=body)
                                      for _ in range(6)))
    assert all(r.status_code == 200 for r in done), [r.text for r in done]
    results = [r.json() for r in done]
    assert {r["lane"] for r in results} == {"medium"}
    spread = max(r["finished_at"] for r in results) - min(r["created_at"] for r in results)
    assert spread < 4.0, f"took {spread:.1f} s: the queue backed up and the bound lifted"  # the test's premise
    assert (most_at_once(results) <= 2) is bounded, results


async def test_a_request_misfiled_by_the_gateway_runs_on_the_engine_of_its_real_lane(redis_url, prefix,
                                                                                     loaded_models):
    """The gateway's estimate (bytes / 3) files 150 '~' under the short lane; the real tokenizer counts
    150 tokens, a medium request. The short lane's engine hands it to the engine serving the medium lane,
    which computes it once; the short engine never does."""
    import dataclasses

    from shared.lanes import DEFAULT_LANES

    two_engines = (dataclasses.replace(DEFAULT_LANES[0], engine="short"), *DEFAULT_LANES[1:])
    settings = make_settings(redis_url, prefix, models=(dataclasses.replace(LLAMA, lanes=two_engines),))
    async with running_worker(settings, loaded_models) as w, running_gateway(settings) as gw:
        engines = w.worker.engines["tiny-llama"]
        assert len(engines.loops) == 2  # short on its own engine, medium and long together
        r = await gw.client.post("/v1/models/tiny-llama/requests?wait=30", json={
            "input": {"prompt": "~" * 150}, "params": {"max_new_tokens": 8, "ignore_eos": True}})
        short = await gw.client.post("/v1/models/tiny-llama/requests?wait=30", json={
            "input": {"prompt": "hello"}, "params": {"max_new_tokens": 8, "ignore_eos": True}})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "succeeded", body
    assert body["lane"] == "short"  # where the gateway filed it
    assert body["output"]["prompt_tokens"] >= 150
    main_calls = engines.for_lane("medium").runner.model_calls  # type: ignore[attr-defined]
    short_calls = engines.for_lane("short").runner.model_calls  # type: ignore[attr-defined]
    assert main_calls.get(body["id"]) == 1 and body["id"] not in short_calls
    assert short.json()["status"] == "succeeded" and short_calls.get(short.json()["id"]) == 1
