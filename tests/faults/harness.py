"""Fault-injection harness: a Redis of our own (AOF on), real worker processes, a ledger of accepted ids. With
`BATCHGATE_TEST_REDIS=cluster`, the Redis of our own is a Redis Cluster of 3 masters and 3 replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from shared.config import Settings
from shared.embedded_redis import free_port
from shared.redis_io import make_sync_redis
from tests.redis_cluster import LocalCluster, start_cluster
from tests.stack import running_gateway

FIGURES: list[dict[str, Any]] = []  # printed at the end of the session (see conftest.py)


class OwnRedis:
    """A redis-server on a free loopback port, AOF with fsync on every write, that tests may kill."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.TemporaryDirectory(prefix="batchgate-faults-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir.name,
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.dir.cleanup()


@dataclass
class WorkerProc:
    env: dict[str, str]
    name: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProc:
        self.proc = subprocess.Popen([sys.executable, "-m", "batchgate", "worker"], env=self.env,
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        return self

    async def wait_ready(self, r: redis.Redis, prefix: str, timeout: float = 120) -> None:
        """Until the worker has registered; the event loop (the in-process gateway's too) runs meanwhile, as a
        gateway's does while a worker starts elsewhere."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited during start-up:\n{self.log.read_text()[-3000:]}")
            if r.hexists(f"{prefix}:workers", self.name):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float = 60) -> int:
        """Its exit code, once it has exited (the event loop runs meanwhile)."""
        assert self.proc is not None
        return await asyncio.to_thread(self.proc.wait, timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class OwnCluster:
    """A Redis Cluster of our own (`tests.redis_cluster`), with the calls the scenarios make of `OwnRedis`; `kill9`
    kills the master that serves `key` (a failover, not a restart: a replica takes over)."""

    def __init__(self, *, appendonly: bool = False) -> None:
        self.appendonly = appendonly
        self.local: LocalCluster | None = None

    @property
    def url(self) -> str:
        assert self.local is not None
        return self.local.url

    def start(self) -> None:
        self.local = start_cluster(appendonly=self.appendonly)

    def client(self) -> redis.Redis:
        return make_sync_redis(self.url, socket_timeout=5)  # type: ignore[no-any-return]

    def master_of(self, key: str) -> int:
        """The port of the master serving `key` now."""
        node = self.client().get_node_from_key(key)
        return int(node.port)

    def kill9(self, key: str) -> int:
        """Kill -9 the master serving `key`; returns its port."""
        assert self.local is not None
        port = self.master_of(key)
        next(n for n in self.local.nodes if n.port == port).kill()
        return port

    def restart(self, port: int) -> None:
        """Bring a killed node back: it rejoins as a replica of the node that took over."""
        assert self.local is not None
        next(n for n in self.local.nodes if n.port == port).restart()

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()


def own_redis() -> OwnRedis | OwnCluster:
    return OwnCluster() if os.environ.get("BATCHGATE_TEST_REDIS") == "cluster" else OwnRedis()


@dataclass
class Cluster:
    """The system under test: our Redis, a gateway in-process, worker processes we can hurt."""

    redis: Any  # OwnRedis | OwnCluster
    prefix: str
    env: dict[str, str]
    settings: Settings
    client: httpx.AsyncClient
    tmp: Path
    workers: list[WorkerProc] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    rejected: int = 0
    unavailable: int = 0

    async def worker(self, name: str, **extra_env: str) -> WorkerProc:
        """A worker process, once it has registered (seconds: it loads its models)."""
        env = {**self.env, "BATCHGATE_WORKER_NAME": name, **extra_env}
        w = WorkerProc(env, name, self.tmp / f"{name}.log").start()
        self.workers.append(w)
        await w.wait_ready(self.redis.client(), self.prefix)
        return w

    async def submit(self, body: dict[str, Any], *, wait: float = 0, headers: dict[str, str] | None = None,
                     model: str = "tiny-llama") -> httpx.Response:
        r = await self.client.post(f"/v1/models/{model}/requests", params={"wait": wait} if wait else None,
                                   json=body, headers=headers)
        if r.status_code in (200, 202):
            rid = r.json()["id"]
            if rid not in self.accepted:
                self.accepted.append(rid)
        elif r.status_code == 429:
            self.rejected += 1
        elif r.status_code == 503:
            self.unavailable += 1
        return r

    async def settle(self, timeout: float = 90) -> dict[str, dict[str, Any]]:
        """Wait for every accepted id to reach a terminal state; read each twice to prove it is stable."""
        end = time.monotonic() + timeout
        final: dict[str, dict[str, Any]] = {}

        async def one(rid: str) -> None:
            while time.monotonic() < end:
                try:
                    r = await self.client.get(f"/v1/requests/{rid}", params={"wait": min(10, end - time.monotonic())})
                except httpx.TransportError:  # a pooled keep-alive connection the server had just closed
                    continue  # a read is idempotent: ask again, as any client would
                if r.status_code == 200 and r.json()["status"] in ("succeeded", "failed", "expired", "cancelled"):
                    final[rid] = r.json()
                    return
                if r.status_code == 503:
                    await asyncio.sleep(0.2)
        await asyncio.gather(*(one(rid) for rid in self.accepted))
        return final

    async def ledger(self, name: str, t_fault: float, timeout: float = 90,
                     **extra: Any) -> dict[str, dict[str, Any]]:
        final = await self.settle(timeout)
        recovery = time.monotonic() - t_fault
        again = {rid: (await self.client.get(f"/v1/requests/{rid}")).json() for rid in final}
        changed = sum(1 for rid in final if (final[rid]["status"], final[rid]["output"], final[rid]["finished_at"])
                      != (again[rid]["status"], again[rid]["output"], again[rid]["finished_at"]))
        row = {
            "scenario": name, "accepted": len(self.accepted), "terminal": len(final),
            "lost": len(self.accepted) - len(final), "visible_duplicates": changed,
            "re_executed": sum(1 for r in final.values() if r.get("attempts", 0) > 1),
            "recovery_s": round(recovery, 2), **extra,
        }
        FIGURES.append(row)
        print("\nFAULT", row)
        return final

    def stop_workers(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGTERM)
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(60)  # teardown: nothing is served any more
                except subprocess.TimeoutExpired:
                    w.signal(signal.SIGKILL)


@asynccontextmanager
async def cluster(tmp_path: Path, model_cache: Path, prefix: str, *, own: OwnRedis | OwnCluster | None = None,
                  **env_extra: str) -> AsyncIterator[Cluster]:
    own = own or own_redis()
    own.start()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_") and k != "REDIS_URL"},
        "BATCHGATE_REDIS_URL": own.url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_MODELS": "tiny-llama",
        "BATCHGATE_MODEL_CACHE": str(model_cache), "BATCHGATE_RECLAIM_IDLE_S": "2", "BATCHGATE_MAX_DELIVERIES": "2",
        "BATCHGATE_DRAIN_BUDGET_S": "1", "BATCHGATE_WORKER_METRICS_PORT": "0", "BATCHGATE_LOG_FORMAT": "json",
        "BATCHGATE_INTAKE_BLOCK_MS": "200", "BATCHGATE_EXPIRY_GRACE_S": "5", "BATCHGATE_AUTH": "off", **env_extra,
    }
    settings = Settings.from_environ(env)
    async with running_gateway(settings) as gw:
        c = Cluster(own, prefix, env, settings, gw.client, tmp_path)
        try:
            yield c
        finally:
            c.stop_workers()
            own.stop()


LONG = {"input": {"input_ids": list(range(3, 300))}, "params": {"max_new_tokens": 256, "ignore_eos": True},
        "timeout_s": 600}  # generous: admission must not refuse any (the scenarios count what was accepted)
# a generous deadline too: behind a dozen LONG on a loaded CI machine, admission refused one with the default 60 s
SHORT = {"input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 8, "ignore_eos": True}, "timeout_s": 600}


async def until(predicate: Any, timeout: float = 30, every: float = 0.05) -> None:
    """Re-check a condition on state the test does not own (bounded)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(every)
