"""Webhook callbacks: real Redis, the real dispatcher, a real HTTP receiver on loopback (allow-listed)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

from gateway.dispatcher import Dispatcher
from shared.callback_store import CallbackStore
from shared.codec import encode
from shared.keys import Keys
from shared.messages import CallbackDelivery, RequestResult
from shared.states import FinishReason, Status
from shared.tenants import TenantStore
from shared.webhooks import WebhookVerificationError, verify
from tests.integration.test_stack import wait_until
from tests.receiver import Received, receiver
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

FAST = dict(callback_base_s=0.05, callback_cap_s=0.4, callback_max_attempts=6, callback_timeout_s=2.0,
            callback_connect_timeout_s=1.0, callback_lease_s=5.0)
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def settings_for(redis_url, prefix, allow="127.0.0.0/8,::1", **kw):
    return make_settings(redis_url, prefix, callback_allow=allow, **{**FAST, **kw})


@contextlib.asynccontextmanager
async def dispatcher(settings, **kw):
    d = Dispatcher(settings, default_secret=kw.pop("secret", SECRET), rng=random.Random(0), **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    await d.ready.wait()
    try:
        yield d
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def delivered_once(gw, rx) -> Received:
    """A request with a callback to `rx`, completed; its one delivery as `rx` received it."""
    rid = await submit(gw, rx.url)
    await complete(gw, rid)
    await wait_until(lambda: _true(len(rx.requests) == 1))
    return rx.requests[0]


async def complete(gw, rid: str, status: Status = Status.SUCCEEDED) -> None:
    """A worker's completion, minus the model: the same finish script, so the same webhook enqueue."""
    rec = await gw.service.store.get(rid)
    await gw.service.store.finish(RequestResult(id=rid, status=status, output={"ok": True},
                                                finish_reason=FinishReason.DONE, finished_ms=int(time.time() * 1000)),
                                  rec.meta)


async def submit(gw, url: str, events=("completed",)) -> str:
    r = await gw.client.post("/v1/models/minilm/requests", json={
        "input": {"text": "x"}, "callback": {"url": url, "events": list(events)}})
    assert r.status_code == 202, r.text
    return r.json()["id"]


async def callback_of(gw, rid: str) -> dict:
    return (await gw.client.get(f"/v1/requests/{rid}")).json()["callback"]


async def test_signed_delivery_verified_by_standardwebhooks(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with receiver() as rx, running_gateway(settings) as gw, dispatcher(settings):
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _true(len(rx.requests) == 1))
        got = rx.requests[0]
        payload = verify(SECRET, got.body, got.headers)  # the library's own verification
        view = (await gw.client.get(f"/v1/requests/{rid}")).json()
        assert payload["id"] == rid and payload["status"] == "succeeded" and payload["output"] == view["output"]
        assert got.headers["webhook-id"].startswith("msg_") and got.headers["batchgate-event"] == "completed"
        with pytest.raises(WebhookVerificationError):
            verify("whsec_" + "A" * 32, got.body, got.headers)
        await wait_until(lambda: _cb_status(gw, rid, "delivered"))
        cb = await callback_of(gw, rid)
        assert cb["attempts"] == 1 and cb["delivered_at"] is not None


async def _true(v: bool) -> bool:
    return v


async def _cb_attempts(gw, rid: str, n: int) -> bool:
    return (await callback_of(gw, rid)).get("attempts") == n


async def _cb_status(gw, rid: str, status: str) -> bool:
    return (await callback_of(gw, rid)).get("status") == status


async def test_started_and_completed_events_from_a_real_worker(redis_url, prefix, loaded_models):
    settings = settings_for(redis_url, prefix)
    async with receiver() as rx, running_worker(settings, loaded_models), running_gateway(settings) as gw, \
            dispatcher(settings):
        rid = await submit(gw, rx.url, events=("started", "completed"))
        await wait_until(lambda: _true(len(rx.requests) == 2))
        events = sorted(r.headers["batchgate-event"] for r in rx.requests)
        assert events == ["completed", "started"]
        ids = {r.headers["webhook-id"] for r in rx.requests}
        assert len(ids) == 2 and all(rid.removeprefix("req_") in i for i in ids)


async def test_each_events_delivery_is_shown_and_a_dead_started_one_is_replayed(redis_url, prefix, loaded_models):
    """A started webhook that died stays visible, and replayable, once the completed one was delivered (the view
    showed only the latest delivery: 'delivered', with nothing to replay)."""
    down = {"started": True}

    def policy(rec: Received, n: int):
        return (500, {}, 0.0) if down["started"] and rec.headers["batchgate-event"] == "started" else (200, {}, 0.0)

    settings = settings_for(redis_url, prefix, callback_max_attempts=2)
    async with receiver(policy) as rx, running_worker(settings, loaded_models), running_gateway(settings) as gw, \
            dispatcher(settings):
        rid = await submit(gw, rx.url, events=("started", "completed"))

        async def settled() -> bool:
            cb = await callback_of(gw, rid)
            return {d["event"]: d["status"] for d in cb.get("deliveries", [])} == {"started": "dead",
                                                                                    "completed": "delivered"}

        await wait_until(settled, timeout=20)
        view = (await gw.client.get(f"/v1/requests/{rid}")).json()
        assert "replay_callback" in view["links"]
        started = next(d for d in view["callback"]["deliveries"] if d["event"] == "started")
        assert started["attempts"] == 2 and started["last_status_code"] == 500
        down["started"] = False
        r = await gw.client.post(f"/v1/requests/{rid}/callback:replay")
        assert r.status_code == 202 and r.json()["callback"]["event"] == "started"
        await wait_until(lambda: _cb_status(gw, rid, "delivered"), timeout=20)
        cb = await callback_of(gw, rid)
        assert {d["event"]: d["status"] for d in cb["deliveries"]} == {"started": "delivered", "completed": "delivered"}
        events = [r.headers["batchgate-event"] for r in rx.requests]
        assert events.count("started") == 3 and events.count("completed") == 1  # two 500s, then the replay
        assert (await gw.client.post(f"/v1/requests/{rid}/callback:replay")).status_code == 409
        # a request submitted without a callback: it exists (a 404 read as an unknown id), nothing to replay
        plain = (await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})).json()["id"]
        none = await gw.client.post(f"/v1/requests/{plain}/callback:replay")
        assert none.status_code == 409 and none.json()["error"]["code"] == "no_callback", none.text


async def test_retries_on_500_and_timeout_then_delivered_once_with_backoff(redis_url, prefix):
    def flaky(rec: Received, n: int):
        if n <= 2:
            return 500, {}, 0.0
        if n == 3:
            return 200, {}, 3.0  # slower than the 2 s attempt timeout
        return 200, {}, 0.0

    settings = settings_for(redis_url, prefix)
    async with receiver(flaky) as rx, running_gateway(settings) as gw, dispatcher(settings):
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _cb_status(gw, rid, "delivered"), timeout=30)
        assert len(rx.requests) == 4
        assert len({r.headers["webhook-id"] for r in rx.requests}) == 1  # one delivery, four attempts
        for r in rx.requests:  # each attempt signed for its own (fresh, second-resolution) timestamp
            verify(SECRET, r.body, r.headers)
        stamps = [int(r.headers["webhook-timestamp"]) for r in rx.requests]
        assert stamps == sorted(stamps) and stamps[-1] > stamps[0]
        gaps = [b.at - a.at for a, b in zip(rx.requests, rx.requests[1:], strict=False)]
        assert gaps[0] >= 0.025 and gaps[1] >= 0.05  # equal-jitter backoff: at least half of 0.05, 0.1
        cb = await callback_of(gw, rid)
        assert cb["attempts"] == 4 and cb["last_error"] is None


async def test_dispatcher_killed_mid_schedule_and_restarted(redis_url, prefix, tmp_path):
    """A dispatcher process is killed (-9) while a delivery waits for its next attempt; a new one
    delivers it, once, on the schedule it left (not from scratch)."""
    calls: list[float] = []

    def fail_twice(rec: Received, n: int):
        calls.append(time.time())
        return (503, {}, 0.0) if n <= 2 else (200, {}, 0.0)

    settings = settings_for(redis_url, prefix, callback_base_s=1.0, callback_cap_s=1.5)
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix,
           "BATCHGATE_CALLBACK_ALLOW": "127.0.0.0/8", "BATCHGATE_CALLBACK_BASE_S": "1.0",
           "BATCHGATE_CALLBACK_CAP_S": "1.5", "BATCHGATE_WEBHOOK_SECRET": SECRET, "BATCHGATE_MODELS": "minilm",
           "BATCHGATE_DISPATCHER_METRICS_PORT": "0", "BATCHGATE_LOG_FORMAT": "json"}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "batchgate", "callbacks"], env=env,
                                stdout=(tmp_path / "d.log").open("a"), stderr=subprocess.STDOUT)

    async with receiver(fail_twice) as rx, running_gateway(settings) as gw:
        proc = start()
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _cb_attempts(gw, rid, 1), timeout=30)  # failed once, retry scheduled
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        due = (await callback_of(gw, rid))["next_attempt_at"]
        assert due is not None  # the schedule is in Redis, not in the dead process
        proc = start()
        try:
            await wait_until(lambda: _cb_status(gw, rid, "delivered"), timeout=40)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        assert len(rx.requests) == 3 and len({r.headers["webhook-id"] for r in rx.requests}) == 1
        assert calls[1] >= due - 0.5  # the restarted dispatcher kept the persisted due time
        assert sum(1 for r in rx.requests if r is rx.requests[-1]) == 1


async def test_410_disables_the_url_for_the_tenant(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with receiver(lambda rec, n: (410, {}, 0.0)) as rx, running_gateway(settings) as gw, \
            dispatcher(settings):
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _cb_status(gw, rid, "disabled"))
        assert len(rx.requests) == 1
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"},
                                                                      "callback": {"url": rx.url}})
        assert r.status_code == 422 and "410" in r.json()["error"]["message"]
        shouted = rx.url.replace("http://", "HTTP://", 1)  # however its scheme and host are spelled
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"},
                                                                      "callback": {"url": shouted}})
        assert r.status_code == 422 and "410" in r.json()["error"]["message"], r.text


async def test_a_disabled_url_refuses_new_requests_in_a_batch_too_but_not_a_replay(redis_url, prefix, tmp_path):
    """A URL disabled by a 410 refuses every new request naming it (one submit or a `:batch` item, 422 naming the
    field; a Batch API batch's `callback_url`, 400: it was taken, and its webhook dropped without a trace); a retry
    with the Idempotency-Key of a request accepted before gets that request back, as it is now."""
    settings = settings_for(redis_url, prefix, files_dir=str(tmp_path / "files"))
    async with running_gateway(settings) as gw:
        url = "http://127.0.0.1:9/gone"
        body = {"input": {"text": "x"}, "callback": {"url": url}}
        first = await gw.client.post("/v1/models/minilm/requests", json=body, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == 202
        await CallbackStore(gw.service.redis, Keys(prefix)).disable("default", url)
        again = await gw.client.post("/v1/models/minilm/requests", json=body, headers={"Idempotency-Key": "k-1"})
        assert again.status_code in (200, 202) and again.json()["id"] == first.json()["id"], again.text
        assert again.headers["idempotent-replayed"] == "true"
        fresh = await gw.client.post("/v1/models/minilm/requests", json=body)
        assert fresh.status_code == 422 and fresh.json()["error"]["field"] == "callback.url"
        batch = await gw.client.post("/v1/models/minilm/requests:batch", json={"requests": [
            {"input": {"text": "y"}}, body, {**body, "idempotency_key": "k-1"}]})
        items = batch.json()["results"]
        assert [it["status"] for it in items] == [202, 422, 202], items
        assert items[1]["error"]["field"] == "requests[1].callback.url" and "410" in items[1]["error"]["message"]
        assert items[2]["id"] == first.json()["id"] and items[2]["replayed"] is True
        upload = await gw.client.post("/v1/files", data={"purpose": "batch"}, files={"file": (
            "in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", '
                        b'"body": {"model": "minilm", "input": "x"}}\n')})
        assert upload.status_code == 200, upload.text
        create = {"input_file_id": upload.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
        refused = await gw.client.post("/v1/batches", json={**create, "callback_url": url})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "callback_url", refused.text
        assert "410" in refused.json()["error"]["message"]
        assert (await gw.client.post("/v1/batches", json={**create, "callback_url": url + "2"})).status_code == 200


async def test_redirects_are_not_followed(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with receiver() as inward:
        async with receiver(lambda rec, n: (302, {"location": inward.url}, 0.0)) as rx, \
                running_gateway(settings) as gw, dispatcher(settings):
            rid = await submit(gw, rx.url)
            await complete(gw, rid)
            await wait_until(lambda: _cb_status(gw, rid, "failed"))
            cb = await callback_of(gw, rid)
            assert "redirect" in cb["last_error"] and len(rx.requests) == 1
        assert inward.connections == 0


async def test_slow_receiver_times_out_then_dead_letter_and_replay(redis_url, prefix):
    slow = {"on": True}

    def policy(rec: Received, n: int):
        return (200, {}, 2.0) if slow["on"] else (200, {}, 0.0)

    from prometheus_client import REGISTRY

    def outcomes() -> dict[str, float]:
        return {o: REGISTRY.get_sample_value("batchgate_webhook_outcomes_total", {"outcome": o}) or 0.0
                for o in ("retry", "dead")}

    settings = settings_for(redis_url, prefix, callback_timeout_s=0.3, callback_max_attempts=2)
    async with receiver(policy) as rx, running_gateway(settings) as gw, dispatcher(settings):
        before = outcomes()
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _cb_status(gw, rid, "dead"), timeout=20)
        cb = await callback_of(gw, rid)
        assert cb["attempts"] == 2 and "timeout" in cb["last_error"]
        # two attempts: one retried, then the last, the dead letter's (not a second "retry")
        assert {o: n - before[o] for o, n in outcomes().items()} == {"retry": 1.0, "dead": 1.0}
        assert (await gw.client.get(f"/v1/requests/{rid}")).json()["status"] == "succeeded"  # result kept
        assert await gw.service.redis.xlen(Keys(prefix).callback_dead()) == 1
        slow["on"] = False
        r = await gw.client.post(f"/v1/requests/{rid}/callback:replay")
        assert r.status_code == 202
        await wait_until(lambda: _cb_status(gw, rid, "delivered"), timeout=20)
        again = await gw.client.post(f"/v1/requests/{rid}/callback:replay")
        assert again.status_code == 409


async def test_a_result_outlives_the_webhook_that_reports_it(redis_url, prefix):
    """A record lives as long as a delivery of it is still to be attempted, and the result TTL after its last
    attempt. By default results are kept an hour and the retry schedule runs about two: the late attempts found no
    record and sent ids only, and a dead letter could be neither read nor replayed (410). Here: results kept 2 s,
    the second attempt 2.5-5 s after the first."""
    settings = settings_for(redis_url, prefix, result_ttl_s=2, callback_base_s=5.0, callback_cap_s=5.0,
                            callback_max_attempts=2)
    async with receiver(lambda rec, n: (500, {}, 0.0)) as rx, running_gateway(settings) as gw, dispatcher(settings):
        rid = await submit(gw, rx.url)
        events = Keys(prefix).events(rid)  # a streaming request's deltas live as long as its record
        await gw.service.redis.xadd(events, {"d": b"x"})
        await gw.service.redis.pexpire(events, 2500)
        await complete(gw, rid)
        await wait_until(lambda: _cb_status(gw, rid, "pending"), timeout=10)
        pttl = await gw.service.redis.pttl(Keys(prefix).record(rid))
        assert pttl > 2000 + 2000  # until the next attempt (at least 2.5 s away), plus the result TTL
        assert await gw.service.redis.pttl(events) > 2000 + 2000  # a resumed stream still finds its deltas
        await wait_until(lambda: _cb_status(gw, rid, "dead"), timeout=15)
        bodies = [json.loads(r.body) for r in rx.requests]
        assert len(bodies) == 2 and [b["status"] for b in bodies] == ["succeeded"] * 2, bodies  # whole, not ids
        assert bodies[1]["output"] == {"ok": True}
        got = await gw.client.get(f"/v1/requests/{rid}")  # readable after the last attempt, for the result TTL
        assert got.status_code == 200 and got.json()["callback"]["status"] == "dead"
        assert 0 < await gw.service.redis.pttl(Keys(prefix).record(rid)) <= 2000  # then it goes, as results do
        assert (await gw.client.post(f"/v1/requests/{rid}/callback:replay")).status_code == 202
        await wait_until(lambda: _cb_attempts(gw, rid, 1), timeout=10)  # replayed, failed again: kept for the next
        assert (await callback_of(gw, rid))["status"] == "pending"
        assert await gw.service.redis.pttl(Keys(prefix).record(rid)) > 2000 + 2000


SSRF_HOSTS = ["127.0.0.1", "localhost", "[::1]", "2130706433", "0177.0.0.1", "0x7f000001", "127.1",
              "[::ffff:127.0.0.1]", "internal.example"]
OTHER_INSIDE = ["http://10.0.0.5/", "http://172.16.0.9/", "http://192.168.1.1/", "http://169.254.169.254/latest/",
                "http://[::ffff:a9fe:a9fe]/", "http://2852039166/", "http://0251.0376.0251.0376/",
                "http://0xa9fea9fe/"]


async def test_ssrf_corpus_is_refused_and_nothing_is_sent(redis_url, prefix):
    settings = settings_for(redis_url, prefix, allow="")  # the allow-list off

    def resolver(host: str, port: int) -> list[str]:
        return {"internal.example": ["127.0.0.1"], "localhost": ["127.0.0.1"]}[host]

    async with receiver(ipv6=True) as rx, running_gateway(settings) as gw:
        urls = [f"http://{h}:{rx.port}/hook" for h in SSRF_HOSTS] + OTHER_INSIDE
        # at submit: IP literals in every spelling are refused outright
        for url in urls:
            if "example" in url or "localhost" in url:
                continue
            r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"},
                                                                          "callback": {"url": url}})
            assert r.status_code == 422, url
        # at delivery: names (and anything that got past submit) are resolved and checked again
        store = CallbackStore(gw.service.redis, Keys(prefix))
        for i, url in enumerate(urls):
            d = CallbackDelivery(f"msg_ssrf{i}", f"req_ssrf{i}", "default", "completed", url, int(time.time() * 1000))
            await gw.service.redis.xadd(Keys(prefix).callback_stream(), {"d": encode(d)})
        async with dispatcher(settings, resolver=resolver):
            async def all_failed() -> bool:
                states = [await store.load(f"msg_ssrf{i}") for i in range(len(urls))]
                return all(s is not None and s[1].status == "failed" for s in states)
            await wait_until(all_failed, timeout=20)
        for i in range(len(urls)):
            _, state = await store.load(f"msg_ssrf{i}")
            assert state.last_error.startswith("refused"), (urls[i], state)
        assert rx.connections == 0 and rx.requests == []


@pytest.mark.slow
async def test_load_1000_completions_with_a_flaky_receiver(redis_url, prefix):
    rng = random.Random(7)
    ok_ids: Counter[str] = Counter()

    def flaky(rec: Received, n: int):
        if rng.random() < 0.3:
            return 500, {}, 0.0
        ok_ids[rec.headers["webhook-id"]] += 1
        return 200, {}, 0.0

    settings = settings_for(redis_url, prefix, callback_base_s=0.02, callback_cap_s=0.2, callback_max_attempts=20)
    async with receiver(flaky) as rx, running_gateway(settings) as gw:
        ids = [await submit(gw, rx.url) for _ in range(1000)]
        t0 = time.monotonic()
        await asyncio.gather(*(complete(gw, rid) for rid in ids))
        async with dispatcher(settings), dispatcher(dataclasses.replace(settings, worker_name="d2")):
            await wait_until(lambda: _true(len(ok_ids) == 1000), timeout=120)
            elapsed = time.monotonic() - t0
        attempts = len(rx.requests)
    figures = {"completions": 1000, "delivered": len(ok_ids), "delivered_twice": sum(v > 1 for v in ok_ids.values()),
               "attempts": attempts, "failed_attempts": attempts - sum(ok_ids.values()), "seconds": round(elapsed, 1)}
    print("\nWEBHOOK LOAD", json.dumps(figures))
    assert figures["delivered"] == 1000 and figures["delivered_twice"] == 0


async def test_secret_rotation_signs_with_both(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with receiver() as rx, running_gateway(settings) as gw, dispatcher(settings, secret=""):
        tenants = TenantStore(gw.service.redis, Keys(prefix))
        (old,) = await tenants.webhook_secrets("default")
        new = await tenants.rotate_webhook_secret("default")
        got = await delivered_once(gw, rx)
        assert len(got.headers["webhook-signature"].split(" ")) == 2
        verify(old, got.body, got.headers)  # receivers on either secret accept it during the overlap
        verify(new, got.body, got.headers)


async def test_bad_callback_fields_get_422(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with running_gateway(settings) as gw:
        for cb in ({"url": "ftp://x.example/"}, {"url": "http://x.example/", "events": ["finished"]}, "http://x",
                   {"events": ["completed"]}, {"url": "http://x.example/", "extra": 1}):
            r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}, "callback": cb})
            assert r.status_code == 422, cb


async def test_thin_payload_when_the_tenant_asks(redis_url, prefix):
    settings = settings_for(redis_url, prefix)
    async with receiver() as rx, running_gateway(settings) as gw, dispatcher(settings):
        await TenantStore(gw.service.redis, Keys(prefix)).set("default", thin_callbacks=True)
        rid = await submit(gw, rx.url)
        await complete(gw, rid)
        await wait_until(lambda: _true(len(rx.requests) == 1))
        payload = verify(SECRET, rx.requests[0].body, rx.requests[0].headers)
        assert payload == {"id": rid, "event": "completed", "links": {"self": f"/v1/requests/{rid}"}}


async def test_rotate_keeps_the_default_secret_from_the_environment(redis_url, prefix):
    """A tenant signing with BATCHGATE_WEBHOOK_SECRET (no secret of its own): `batchgate webhooks rotate` keeps
    that secret beside the new one, so the next delivery carries both signatures (receivers on the old one pass)."""
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix,
           "BATCHGATE_WEBHOOK_SECRET": SECRET}
    out = subprocess.run([sys.executable, "-m", "batchgate.cli", "webhooks", "rotate", "--tenant", "default"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    new = out.stdout.splitlines()[0].strip()
    assert new.startswith("whsec_") and f"also accepted: {SECRET}" in out.stdout
    settings = settings_for(redis_url, prefix)
    async with receiver() as rx, running_gateway(settings) as gw, dispatcher(settings, secret=SECRET):
        got = await delivered_once(gw, rx)
        assert len(got.headers["webhook-signature"].split(" ")) == 2
        verify(SECRET, got.body, got.headers)
        verify(new, got.body, got.headers)


async def test_a_tarpit_receiver_does_not_delay_other_destinations(redis_url, prefix):
    """Deliveries are independent: while a receiver takes 3 s per answer, deliveries to another destination
    go out at once (before: they waited for the claimed batch, tarpit included), and the tarpit never has more
    than `per_host` attempts running at once (the rest wait on the schedule, not in the dispatcher's slots)."""
    running = {"now": 0, "max": 0}

    def tarpit(rec: Received, n: int):
        return 200, {}, 3.0

    # a lease longer than an attempt may take (BATCHGATE_CALLBACK_LEASE_S > _TIMEOUT_S, as Settings requires)
    settings = settings_for(redis_url, prefix, callback_timeout_s=6.0, callback_lease_s=10.0)
    async with receiver(tarpit) as slow, receiver() as fast, running_gateway(settings) as gw, \
            dispatcher(settings, per_host=4) as d:
        orig = d._post

        async def counting_post(target, body, headers):
            if target.port == slow.port:
                running["now"] += 1
                running["max"] = max(running["max"], running["now"])
                try:
                    return await orig(target, body, headers)
                finally:
                    running["now"] -= 1
            return await orig(target, body, headers)

        d._post = counting_post
        slow_ids = [await submit(gw, slow.url) for _ in range(10)]
        for rid in slow_ids:
            await complete(gw, rid)
        await wait_until(lambda: _true(len(slow.requests) >= 1))
        lat = []
        for _ in range(5):
            rid = await submit(gw, fast.url)
            t0 = time.monotonic()
            await complete(gw, rid)
            n = len(fast.requests)
            await wait_until(lambda n=n: _true(len(fast.requests) > n), timeout=10)
            lat.append(time.monotonic() - t0)
        assert max(lat) < 1.0, lat
        for rid in slow_ids:
            await wait_until(lambda rid=rid: _cb_status(gw, rid, "delivered"), timeout=30)
        assert running["max"] <= 4 and len(slow.requests) == 10
        # waiting for a busy destination is not an attempt: one attempt each, one webhook-id each
        assert [(await callback_of(gw, rid))["attempts"] for rid in slow_ids] == [1] * 10
        assert len({r.headers["webhook-id"] for r in slow.requests}) == 10


async def test_internal_callback_names_get_422_at_submit_and_the_answer_names_no_env_var(redis_url, prefix):
    settings = settings_for(redis_url, prefix, allow="127.0.0.0/8,dev.localhost")
    async with running_gateway(settings) as gw:
        for url in ("http://localhost:8080/hook", "http://app.localhost/", "http://db.internal/x",
                    "http://printer.local/", "http://10.0.0.5/", "http://169.254.169.254/latest/"):
            r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"},
                                                                          "callback": {"url": url}})
            assert r.status_code == 422, (url, r.text)
            assert "BATCHGATE" not in r.text and "_ALLOW" not in r.text, r.text
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"},
                                                                      "callback": {"url": "http://dev.localhost/"}})
        assert r.status_code == 202, r.text  # allowed by name


async def test_operations_tools_without_the_dispatchers_default_secret_neither_replace_nor_rotate_it(redis_url,
                                                                                                   prefix):
    """A shell without BATCHGATE_WEBHOOK_SECRET (or with another one) must not give a tenant that signs with
    the dispatcher's default a secret of its own: `show` and `rotate` refuse with one line, store nothing, and
    deliveries keep verifying with the default alone."""
    settings = settings_for(redis_url, prefix)
    base = {k: v for k, v in os.environ.items() if k != "BATCHGATE_WEBHOOK_SECRET"}
    base |= {"BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix}
    async with receiver() as rx, running_gateway(settings) as gw, dispatcher(settings, secret=SECRET):
        for env in (base, {**base, "BATCHGATE_WEBHOOK_SECRET": "whsec_" + "b" * 32}):
            for action in ("show", "rotate"):
                out = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "batchgate.cli", "webhooks", action, "--tenant",
                                     "default"], env=env, capture_output=True, text=True, timeout=60)
                assert out.returncode == 1 and "BATCHGATE_WEBHOOK_SECRET" in out.stderr, (action, out)
                assert "Traceback" not in out.stderr and "whsec_" not in out.stdout
        assert (await TenantStore(gw.service.redis, Keys(prefix)).get("default")).webhook_secrets == ()
        got = await delivered_once(gw, rx)
        assert len(got.headers["webhook-signature"].split(" ")) == 1
        verify(SECRET, got.body, got.headers)


async def test_an_operator_allows_a_url_disabled_by_410_again(redis_url, prefix):
    """A 410 disables a URL for its tenant for good (the dispatcher never undoes it); the operator lists such
    URLs with `batchgate webhooks disabled` and allows one again with `webhooks enable URL`."""
    settings = settings_for(redis_url, prefix)
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "batchgate.cli", "webhooks", *args, "--tenant", "default"],
                              env=env, capture_output=True, text=True, timeout=60)

    async with running_gateway(settings) as gw:
        url = "http://127.0.0.1:9/gone"
        await CallbackStore(gw.service.redis, Keys(prefix)).disable("default", url)
        body = {"input": {"text": "x"}, "callback": {"url": url}}
        assert (await gw.client.post("/v1/models/minilm/requests", json=body)).status_code == 422
        listed = await asyncio.to_thread(cli, "disabled")
        assert listed.returncode == 0 and listed.stdout.split() == [url], listed
        enabled = await asyncio.to_thread(cli, "enable", url)
        assert enabled.returncode == 0 and "allowed again" in enabled.stdout, enabled
        assert (await gw.client.post("/v1/models/minilm/requests", json=body)).status_code == 202
        again = await asyncio.to_thread(cli, "enable", url)
        assert again.returncode == 1 and "not disabled" in again.stderr
        missing = await asyncio.to_thread(cli, "enable")
        assert missing.returncode == 2 and "needs the URL" in missing.stderr


async def test_a_request_past_its_deadline_with_no_worker_alive_gets_its_webhook(redis_url, prefix):
    """No worker (scaled to zero, or crashing) and a caller that only waits for the webhook: nobody reads the
    request, so nothing expired it and its `completed` webhook never went. The dispatcher expires requests with a
    webhook once their deadline (plus the grace) passes; a request that completes leaves its list at once, and a
    record this build cannot read (a newer writer's, in a rolling upgrade) does not stop the sweep."""
    settings = settings_for(redis_url, prefix, expiry_grace_s=0.2)
    keys = Keys(prefix)
    async with receiver() as rx, running_gateway(settings) as gw:
        redis = gw.service.redis
        await redis.hset(keys.record("req_unreadable"), mapping={"state": "queued", "meta": b"\xff"})
        await redis.zadd(keys.callback_deadlines(), {"req_unreadable": 0})  # heads the list
        async with dispatcher(settings):
            r = await gw.client.post("/v1/models/minilm/requests", json={
                "input": {"text": "x"}, "timeout_s": 1, "callback": {"url": rx.url}})
            assert r.status_code == 202, r.text
            rid = r.json()["id"]
            done = await delivered_once(gw, rx)  # another one, completed as a worker would: off the list at once
            other = done.headers["webhook-id"].removeprefix("msg_").removesuffix("_completed")
            assert await redis.zscore(keys.callback_deadlines(), other) is None
            await rx.wait_for(2, timeout=10)  # nobody reads `rid` meanwhile
            got = rx.requests[1]
            payload = verify(SECRET, got.body, got.headers)
            assert payload["id"] == rid and payload["status"] == "expired"
            assert got.headers["batchgate-event"] == "completed" and payload["error"]["code"] == "deadline_exceeded"
            remaining = await redis.zrange(keys.callback_deadlines(), 0, -1)
            assert remaining == [b"req_unreadable"]  # kept, looked at again later: not dropped, not fatal


@pytest.mark.standalone  # its own redis-server, started late: a single Redis
async def test_a_dispatcher_started_before_its_redis_waits_for_it(tmp_path, prefix, monkeypatch):
    """No Redis yet when the dispatcher starts (a boot order): it waits, is ready once Redis answers and serves, never
    exits with a traceback into a supervisor's restart loop; stopped while it waits, it ends cleanly."""
    from shared import redis_io
    from tests.fakes import not_ready_within, stops_while_waiting
    from tests.stack import free_port

    monkeypatch.setattr(redis_io, "START_WAIT_MAX_S", 0.2)
    port = free_port()
    settings = settings_for(f"redis://127.0.0.1:{port}/0", prefix)
    d = Dispatcher(settings, default_secret=SECRET)
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    await not_ready_within(task, d.ready, 1.0)
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        await asyncio.wait_for(d.ready.wait(), 15)
        stop.set()
        await asyncio.wait_for(task, 20)
    finally:
        server.terminate()
        server.wait(10)
    waiting = Dispatcher(settings, default_secret=SECRET)  # its Redis gone again: stopped while it waits
    stop = asyncio.Event()
    await stops_while_waiting(asyncio.create_task(waiting.run(stop)), stop, waiting.ready)


async def test_what_a_failed_attempt_says_tells_a_refused_connection_from_one_lost_after_sending(redis_url, prefix):
    """An attempt no one took (nothing listens) is a connect error; one whose receiver read the POST and closed the
    connection without an answer may have been taken: it says the connection was lost before an answer (it said
    "connect error", sending operators to the network). Both are retried alike."""
    got: list[bytes] = []

    async def read_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(read_then_close, "127.0.0.1", 0)
    closing_port = server.sockets[0].getsockname()[1]
    with socket.socket() as s:  # a free port: nothing listens there
        s.bind(("127.0.0.1", 0))
        refused_port = s.getsockname()[1]
    settings = settings_for(redis_url, prefix, callback_max_attempts=2)
    async with server, running_gateway(settings) as gw, dispatcher(settings):
        closing = await submit(gw, f"http://127.0.0.1:{closing_port}/hook")
        refused = await submit(gw, f"http://127.0.0.1:{refused_port}/hook")
        for rid in (closing, refused):
            await complete(gw, rid)
        for rid in (closing, refused):
            await wait_until(lambda rid=rid: _cb_status(gw, rid, "dead"), timeout=20)
        lost, unreached = await callback_of(gw, closing), await callback_of(gw, refused)
    assert len(got) == 2 and got[0].startswith(b"POST /hook")  # both attempts reached the receiver
    assert lost["last_error"] == "connection lost before an answer (RemoteProtocolError)", lost
    assert unreached["last_error"] == "connect error (ConnectError)", unreached
