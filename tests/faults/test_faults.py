"""Fault-injection suite (RELIABILITY.md faults 1-10): real Redis (our own, AOF on), real worker
processes, a ledger of every accepted id. Pass: lost = 0 and visible duplicates = 0 everywhere."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from shared.codec import decode
from shared.keys import Keys
from shared.messages import RequestResult
from tests.faults.harness import LONG, SHORT, OwnCluster, OwnRedis, cluster, until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(300)]


def running(c) -> int:
    r = c.redis.client()
    return sum(1 for k in r.scan_iter(f"{c.prefix}:*:rec") if r.hget(k, "state") == b"running")


async def kill9_mid_batch(c) -> float:
    """Worker w-a running 4 or more of 8 long requests, killed (-9); returns when."""
    a = await c.worker("w-a")
    for _ in range(8):
        await c.submit(LONG)
    await until(lambda: running(c) >= 4)
    a.signal(signal.SIGKILL)
    return time.monotonic()


async def test_kill9_mid_batch(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix) as c:
        t_fault = await kill9_mid_batch(c)
        await c.worker("w-b")
        final = await c.ledger("1 kill -9 mid-batch", t_fault)
        assert len(final) == len(c.accepted) == 8
        assert all(r["status"] == "succeeded" for r in final.values())
        assert sum(r["attempts"] > 1 for r in final.values()) >= 1  # the killed batch really was re-run


def owned_by(c, worker: str) -> int:
    r = c.redis.client()
    return sum(len(r.xpending_range(f"{c.prefix}:{{m:tiny-llama}}:lane:{lane}", "workers", "-", "+", 100,
                                    consumername=worker)) for lane in ("short", "medium", "long"))


async def test_kill9_the_work_it_held_goes_on_within_seconds_not_after_the_reclaim_idle_time(
        tmp_path, model_cache, prefix):
    # reclaim by idle time only after 10 minutes here: the ledger's bound (90 s) is met only if the departed-worker
    # path takes the entries (a restart under the worker's name, or a live peer once the liveness mark expired)
    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_RECLAIM_IDLE_S="600") as c:
        t_fault = await kill9_mid_batch(c)
        await c.worker("w-a")  # a supervisor's restart under the same name
        final = await c.ledger("1b kill -9, restarted under its name", t_fault)
        assert len(final) == 8 and all(r["status"] == "succeeded" for r in final.values())
        assert sum(r["attempts"] > 1 for r in final.values()) >= 1
        c.accepted.clear()
        await c.worker("w-b")
        for _ in range(12):
            await c.submit(LONG)
        await until(lambda: owned_by(c, "w-a") >= 2 and owned_by(c, "w-b") >= 2)
        c.workers[1].signal(signal.SIGKILL)  # the restarted w-a
        t_fault = time.monotonic()
        final = await c.ledger("1c kill -9 beside a live worker", t_fault)
        assert len(final) == 12 and all(r["status"] == "succeeded" for r in final.values())
        assert sum(r["attempts"] > 1 for r in final.values()) >= 1


async def test_kill9_after_result_write_before_ack(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix) as c:
        a = await c.worker("w-a", BATCHGATE_FAULTS="kill_after_result_write=1")
        rs = await asyncio.gather(*(c.submit(SHORT) for _ in range(6)))
        assert all(r.status_code == 202 for r in rs)
        await until(lambda: not a.alive)
        t_fault = time.monotonic()
        r = c.redis.client()
        written = {rid: r.hget(f"{prefix}:{{r:{rid}}}:rec", "result") for rid in c.accepted}
        written = {rid: decode(v, RequestResult) for rid, v in written.items() if v}
        assert written, "the worker should have written some results before dying"
        await c.worker("w-b")
        final = await c.ledger("2 kill -9 after result write, before XACK", t_fault,
                               written_before_kill=len(written))
        assert len(final) == 6
        for rid, res in written.items():  # the stored result is unchanged: no second execution overwrote it
            assert final[rid]["finished_at"] == res.finished_ms / 1000 and final[rid]["attempts"] == 1


async def test_kill9_after_ack_waiters_still_get_results(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix) as c:
        ids = [(await c.submit(SHORT)).json()["id"] for _ in range(4)]
        t0 = time.monotonic()
        waiters = [asyncio.create_task(c.client.get(f"/v1/requests/{rid}", params={"wait": 60})) for rid in ids]
        a = await c.worker("w-a", BATCHGATE_FAULTS="kill_after_ack=1")  # the waiters wait while it starts
        await until(lambda: not a.alive)
        got = await asyncio.gather(*waiters)
        finished = [g for g in got if g.json()["status"] == "succeeded"]
        # woken by the event, not by their 60 s timeout (the worker's start-up counts: seconds, not tens)
        assert finished and time.monotonic() - t0 < 45
        t_fault = time.monotonic()
        await c.worker("w-b")
        final = await c.ledger("3 kill -9 after XACK (done event already sent)", t_fault,
                               waiters_woken=len(finished))
        assert len(final) == 4


async def test_sigterm_mid_batch_hands_back(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_DRAIN_BUDGET_S="0.3") as c:
        a = await c.worker("w-a")
        for _ in range(10):
            await c.submit(LONG)
        # a bound, not a timing: on a CI machine shared with the other pass the worker took past 30 s to start four
        await until(lambda: running(c) >= 4, timeout=120)
        a.signal(signal.SIGTERM)
        t_fault = time.monotonic()
        assert await a.wait(30) == 0
        drained_in = time.monotonic() - t_fault
        r = c.redis.client()
        for lane in ("short", "medium", "long"):
            stream = f"{prefix}:{{m:tiny-llama}}:lane:{lane}"
            assert r.xpending_range(stream, "workers", "-", "+", 10, consumername="w-a") == []
            assert "w-a" not in [x["name"].decode() for x in r.xinfo_consumers(stream, "workers")]
        await c.worker("w-b")
        final = await c.ledger("4 SIGTERM mid-batch (drain, hand back)", t_fault, drain_s=round(drained_in, 2))
        assert len(final) == 10 and all(v["status"] == "succeeded" for v in final.values())


async def test_long_batch_beyond_idle_threshold_is_not_stolen_and_hung_worker_is(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_RECLAIM_IDLE_S="1.0") as c:
        a = await c.worker("w-a")
        b = await c.worker("w-b")
        t0 = time.monotonic()
        await asyncio.gather(*(c.submit(LONG) for _ in range(16)))
        final = await c.ledger("5a batch longer than the idle threshold, live workers", t0)
        assert all(v["attempts"] == 1 for v in final.values()), [v["attempts"] for v in final.values()]
        assert max(v["finished_at"] - v["started_at"] for v in final.values()) > 1.0  # really longer than it
        c.accepted.clear()
        b.signal(signal.SIGTERM)  # leave w-a alone with the next requests
        assert await b.wait(30) == 0
        codes = [(await c.submit(LONG)).status_code for _ in range(12)]
        assert codes == [202] * 12, codes
        await until(lambda: running(c) >= 2, every=0.01)
        a.signal(signal.SIGSTOP)  # hung: alive but silent, renews nothing
        t_fault = time.monotonic()
        await c.worker("w-c")
        final = await c.ledger("5b hung worker (SIGSTOP) reclaimed", t_fault)
        a.signal(signal.SIGCONT)
        assert len(final) == 12 and all(v["status"] == "succeeded" for v in final.values())


async def test_poison_requests(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix,
                       BATCHGATE_FAULTS="raise_token=6666,kill_token=7777") as c:
        await c.worker("w-0")
        mates = [{"input": {"input_ids": [5, 6, 7 + i]}, "params": {"max_new_tokens": 4}} for i in range(4)]
        bad = {"input": {"input_ids": [5, 6666, 7]}, "params": {"max_new_tokens": 4}}
        got = await asyncio.gather(*(c.submit(b, wait=30) for b in [*mates, bad]))
        assert [g.json()["status"] for g in got] == ["succeeded"] * 4 + ["failed"]
        assert got[-1].json()["error"]["code"] == "model_error"
        killer = (await c.submit({"input": {"input_ids": [7777, 5]}, "params": {"max_new_tokens": 4}})).json()["id"]
        t_fault = time.monotonic()
        restarts = 0
        end = time.monotonic() + 120
        while time.monotonic() < end:  # a supervisor: restart workers the poison request kills
            rec = (await c.client.get(f"/v1/requests/{killer}", params={"wait": 1})).json()
            if rec["status"] == "failed":
                break
            if not any(w.alive for w in c.workers):
                restarts += 1
                await c.worker(f"w-{restarts}")
        final = await c.ledger("6 poison requests (raises / kills workers)", t_fault, worker_restarts=restarts)
        assert final[killer]["status"] == "failed" and final[killer]["error"]["code"] == "poison_request"
        assert c.redis.client().xlen(f"{prefix}:{{m:tiny-llama}}:dead") == 1
        assert 2 <= restarts <= 4


@pytest.mark.standalone
async def test_redis_restart_and_client_kill(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix, own=OwnRedis()) as c:
        await c.worker("w-a")
        for _ in range(12):
            await c.submit(LONG)
        await until(lambda: running(c) >= 2)
        c.redis.kill9()
        t_fault = time.monotonic()
        during = [await c.submit(SHORT) for _ in range(3)]
        assert [r.status_code for r in during] == [503] * 3  # never 202 for a request it could not store
        assert all(r.headers.get("retry-after") for r in during)
        assert (await c.client.get("/readyz")).status_code == 503
        await asyncio.sleep(1.0)
        c.redis.start()  # same port, same AOF directory
        await until(lambda: _redis_up(c), timeout=30)
        await until_async(lambda: _ready(c), timeout=30)
        for _ in range(4):
            r = await c.submit(SHORT)
            assert r.status_code == 202
        final = await c.ledger("7a Redis kill -9 + restart (AOF, fsync always)", t_fault,
                               refused_while_down=len(during))
        assert len(final) == 16
        c.accepted.clear()
        for _ in range(6):
            await c.submit(LONG)
        await until(lambda: running(c) >= 2)
        c.redis.client().client_kill_filter(_type="normal")
        t_fault = time.monotonic()
        final = await c.ledger("7b CLIENT KILL TYPE normal", t_fault)
        assert len(final) == 6


@pytest.mark.standalone
async def test_a_redis_that_answers_nothing_is_a_prompt_503(tmp_path, model_cache, prefix):
    """A stopped (SIGSTOP) Redis accepts connections and answers nothing: callers get 503 within seconds (it took
    90 s when every command was retried after its socket timeout), and the gateway serves again once it resumes."""
    async with cluster(tmp_path, model_cache, prefix, own=OwnRedis()) as c:
        assert (await c.submit(SHORT)).status_code == 202
        assert c.redis.proc is not None
        c.redis.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            hung = await c.submit(SHORT)
            took = time.monotonic() - t0
            ready = await c.client.get("/readyz")
        finally:
            c.redis.proc.send_signal(signal.SIGCONT)
        assert hung.status_code == 503 and hung.headers.get("retry-after"), hung.text
        assert took < 15, took  # one socket timeout (3 s + the durable-write wait), not three per command
        assert ready.status_code == 503
        await until_async(lambda: _ready(c), timeout=30)
        assert (await c.submit(SHORT)).status_code == 202
        keys = Keys(prefix)  # what was accepted, before the stop and after it, is stored
        assert len(c.accepted) == 2 and all(c.redis.client().exists(keys.record(rid)) for rid in c.accepted)


def _redis_up(c) -> bool:
    try:
        return bool(c.redis.client().ping())
    except Exception:
        return False


async def _ready(c) -> bool:
    return (await c.client.get("/readyz")).status_code == 200


async def until_async(predicate, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_retried_submit_with_idempotency_key(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix) as c:
        await c.worker("w-a")
        t0 = time.monotonic()
        first = await c.submit(SHORT, headers={"Idempotency-Key": "order-1"})
        again = await c.submit(SHORT, headers={"Idempotency-Key": "order-1"})
        assert first.status_code == 202 and again.status_code in (200, 202)
        assert again.json()["id"] == first.json()["id"] and again.headers["idempotent-replayed"] == "true"
        other = await c.submit({**SHORT, "params": {"max_new_tokens": 9}}, headers={"Idempotency-Key": "order-1"})
        assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
        racing = await asyncio.gather(*(c.client.post("/v1/models/tiny-llama/requests", json=SHORT,
                                                      headers={"Idempotency-Key": "order-2"}) for _ in range(8)))
        ids = {r.json()["id"] for r in racing if r.status_code in (200, 202)}
        assert len(ids) == 1 and all(r.status_code in (200, 202, 409) for r in racing)
        c.accepted.extend(ids)
        final = await c.ledger("8 retried submit (Idempotency-Key), incl. 8 racing", t0)
        assert len(final) == 2 and all(v["attempts"] == 1 for v in final.values())


async def test_subscribe_race(tmp_path, model_cache, prefix):
    async with cluster(tmp_path, model_cache, prefix) as c:
        await c.worker("w-a")
        t0 = time.monotonic()
        ids = [(await c.submit(SHORT, wait=30)).json()["id"] for _ in range(3)]  # finished before anyone waits
        for rid in ids:
            t = time.monotonic()
            r = await c.client.get(f"/v1/requests/{rid}", params={"wait": 30})
            assert r.json()["status"] == "succeeded" and time.monotonic() - t < 1
        await c.ledger("9 result ready before the waiter subscribes", t0)


async def test_backlog_past_the_stream_cap(tmp_path, model_cache, prefix):
    lanes = '[{"name": "all", "window_ms": 5, "max_backlog": 20}]'
    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_MODEL__TINY_LLAMA__LANES=lanes) as c:
        r = c.redis.client()
        stream = f"{prefix}:{{m:tiny-llama}}:lane:all"
        base = r.info("memory")["used_memory"]
        codes = [(await c.submit(SHORT)).status_code for _ in range(50)]
        assert codes.count(202) == 20 and codes.count(429) == 30
        assert r.xlen(stream) == 20  # nothing unread was trimmed
        peak = r.info("memory")["used_memory"]
        t0 = time.monotonic()
        await c.worker("w-a")
        final = await c.ledger("10 backlog past the stream cap", t0, rejected_429=codes.count(429))
        assert len(final) == 20
        await until(lambda: r.xlen(stream) == 0)
        after = r.info("memory")["used_memory"]
        # the stream is empty again; what remains are the 20 result records (kept for their TTL)
        assert after - base < max(2 << 20, (peak - base) * 2), (base, peak, after)


STREAMED = {"input": {"input_ids": list(range(3, 60))}, "timeout_s": 600, "stream": True,
            "params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0}}  # sampled, no seed


async def follow_events(c, rid: str) -> list[dict]:
    """A caller reading the request's event stream across the fault, reconnecting with Last-Event-ID."""
    events: list[dict] = []
    last = None
    while not events or events[-1]["event"] != "done":
        headers = {"Last-Event-ID": last} if last else {}
        async with c.client.stream("GET", f"/v1/requests/{rid}/events", headers=headers) as r:
            current: dict = {}
            async for line in r.aiter_lines():
                if not line and current:
                    events.append(current)
                    last = current.get("id", last)
                    current = {}
                    if events[-1]["event"] == "done":
                        break
                elif line and not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    current[name] = __import__("json").loads(value) if name == "data" else value
    return events


def stream_is_whole(events: list[dict]) -> dict:
    """Every token once, in order, and the deltas add up to the final output, though the request ran twice."""
    out = events[-1]["data"]["output"]
    deltas = [e["data"] for e in events if e["event"] == "delta"]
    assert [d["index"] for d in deltas] == [sum(len(x["token_ids"]) for x in deltas[:i]) for i in range(len(deltas))]
    assert [t for d in deltas for t in d["token_ids"]] == out["token_ids"]
    assert "".join(d["text"] for d in deltas) == out["text"]
    return events[-1]["data"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_a_stream_survives_its_worker_without_a_repeated_or_changed_token(tmp_path, model_cache, prefix, sig):
    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_DRAIN_BUDGET_S="0.2") as c:
        a = await c.worker("w-a")
        ids = [(await c.submit(STREAMED)).json()["id"] for _ in range(3)]
        readers = [asyncio.create_task(follow_events(c, rid)) for rid in ids]
        r = c.redis.client()
        await until(lambda: all(r.xlen(f"{prefix}:{{r:{rid}}}:ev") >= 5 for rid in ids))  # mid-stream
        a.signal(sig)
        t_fault = time.monotonic()
        await a.wait(30)
        await c.worker("w-b")
        streams = await asyncio.wait_for(asyncio.gather(*readers), 240)
        final = await c.ledger(f"streaming: {signal.Signals(sig).name} mid-stream", t_fault)
        for events in streams:
            done = stream_is_whole(events)
            assert done["status"] == "succeeded" and len(done["output"]["token_ids"]) == 200
        assert len(final) == 3
        assert sum(v["attempts"] > 1 for v in final.values()) >= 1 or sig == signal.SIGTERM


async def test_a_1000_line_batch_survives_a_worker_killed_mid_way(tmp_path, model_cache, prefix):
    """The Batch API through the official openai client: a worker kill -9'd mid-batch loses no line and
    repeats none."""
    import io
    import json

    from openai import AsyncOpenAI

    from gateway.batch_runner import BatchRunner

    async with cluster(tmp_path, model_cache, prefix, BATCHGATE_FILES_DIR=str(tmp_path / "files")) as c:
        a = await c.worker("w-a")
        stop = asyncio.Event()
        runner = asyncio.create_task(BatchRunner(c.settings, poll_s=0.05).run(stop))
        client = AsyncOpenAI(base_url=str(c.client.base_url) + "/v1", api_key="x", max_retries=0)
        url = "/v1/models/tiny-llama/requests"
        lines = [json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": url, "body": {
            "input": {"input_ids": [5 + i % 50, 6, 7]}, "params": {"max_new_tokens": 4, "ignore_eos": True}}})
            for i in range(1000)]
        f = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
        while (await client.batches.retrieve(b.id)).request_counts.completed < 300:
            await asyncio.sleep(0.1)
        a.signal(signal.SIGKILL)
        t_fault = time.monotonic()
        await c.worker("w-b")
        while (done := await client.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(runner, 30)
        assert done.status == "completed", done
        out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        assert len(out) == 1000 and sorted(x["custom_id"] for x in out) == sorted(f"c-{i}" for i in range(1000))
        assert done.request_counts.completed == 1000 and done.request_counts.failed == 0
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert len({x["response"]["request_id"] for x in out}) == 1000
        from tests.faults.harness import FIGURES
        FIGURES.append({"scenario": "batch: kill -9 a worker mid-batch (1,000 lines)", "accepted": 1000,
                        "terminal": len(out), "lost": 1000 - len(out), "visible_duplicates": len(out) - 1000,
                        "re_executed": "-", "recovery_s": round(time.monotonic() - t_fault, 2)})


@pytest.mark.standalone
@pytest.mark.parametrize("durable", [False, True], ids=["async-replication", "wait-1-replica"])
async def test_a_master_killed_under_load_fails_over(tmp_path, model_cache, prefix, durable):
    """Redis Cluster, 3 masters and 3 replicas: kill -9 the master serving the model's lanes (and a third of the
    records) while requests arrive; a replica takes over; the killed node comes back 6 s later as its replica.
    With `BATCHGATE_REDIS_WAIT_REPLICAS=1` no accepted request may be lost (while the new master has no replica,
    submits answer 503: nothing can be made durable); with Redis' asynchronous replication the ledger reports
    what was lost."""
    env = {"BATCHGATE_REDIS_WAIT_REPLICAS": "1", "BATCHGATE_REDIS_WAIT_MS": "2000"} if durable else {}
    async with cluster(tmp_path, model_cache, prefix, own=OwnCluster(), **env) as c:
        await c.worker("w-a")
        stop = asyncio.Event()
        answers: list[int] = []

        async def load() -> None:
            while not stop.is_set():
                try:
                    answers.append((await c.submit(SHORT)).status_code)
                except Exception:
                    answers.append(0)
                await asyncio.sleep(0.02)

        task = asyncio.create_task(load())
        await asyncio.sleep(3)
        killed = c.redis.kill9(f"{prefix}:{{m:tiny-llama}}:lane:short")
        t_fault = time.monotonic()
        await asyncio.sleep(6)  # the failover (node timeout 1.5 s)
        await asyncio.to_thread(c.redis.restart, killed)
        await asyncio.sleep(8)  # it rejoins as a replica and syncs: requests again
        stop.set()
        await task
        final = await c.ledger(f"11 cluster failover, {'WAIT 1 replica' if durable else 'async replication'}",
                               t_fault, timeout=120, refused=sum(a != 202 for a in answers), killed_port=killed)
        after = answers[-20:]
        assert after.count(202) >= 15, after  # the cluster took over: submits are accepted again
        if durable:
            assert len(final) == len(c.accepted), "a request accepted with WAIT was lost in the failover"
        else:  # what asynchronous replication lost is reported (the ledger row), and nothing else went wrong
            assert len(final) >= len(c.accepted) - sum(a == 202 for a in answers[:len(answers) // 2])
