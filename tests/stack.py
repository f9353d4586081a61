"""An in-process stack for integration tests: a real uvicorn gateway and a real Worker, on real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.server import server_config
from gateway.service import GatewayService
from gpu_worker.worker import Worker
from shared.config import BUILTIN_MODELS, ModelSpec, Settings
from shared.embedded_redis import free_port


def make_settings(redis_url: str, prefix: str, models: tuple[ModelSpec, ...] | None = None,
                  **overrides: Any) -> Settings:
    models = models or (BUILTIN_MODELS["minilm"], BUILTIN_MODELS["tiny-llama"])
    overrides.setdefault("auth", "off")
    return Settings(redis_url=redis_url, key_prefix=prefix, models=models, worker_metrics_port=0,
                    worker_name=f"{prefix}-w{free_port()}", intake_block_ms=200, **overrides).validate()


def loader_for(loaded_models: dict[str, Any]) -> Any:
    def load(spec: ModelSpec) -> Any:
        base = loaded_models[spec.source.removeprefix("builtin:")]
        return dataclasses.replace(base, spec=spec)

    return load


@dataclass
class RunningWorker:
    worker: Worker
    stop: asyncio.Event
    task: asyncio.Task[None]

    def model_calls(self, model: str) -> dict[str, int]:
        return self.worker.engines[model].model_calls()


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, loaded_models: dict[str, Any],
                         **kwargs: Any) -> AsyncIterator[RunningWorker]:
    worker = Worker(settings, loader=loader_for(loaded_models), **kwargs)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    ready = asyncio.create_task(worker.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # raises the start-up error
    try:
        yield RunningWorker(worker, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@dataclass
class RunningGateway:
    base_url: str
    service: GatewayService
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def running_gateway(settings: Settings) -> AsyncIterator[RunningGateway]:
    port = free_port()
    service = GatewayService(settings)
    app = create_app(settings, service=service)
    # as `batchgate gateway` runs it (keep-alive above httpx's 5 s: a test that blocks the loop for seconds, as
    # `Cluster.worker` does while a worker starts, must not find its pooled connection closed under it)
    config = server_config(app, dataclasses.replace(settings, host="127.0.0.1", port=port))
    config.lifespan = "on"
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        try:
            yield RunningGateway(base, service, client)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)


def gateway_process(env: Mapping[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`batchgate gateway` as its own process (configured by `env`, which names its port), once ready:
    the process and its base URL. Its output goes to `log`."""
    proc = subprocess.Popen([sys.executable, "-m", "batchgate", "gateway"], env=dict(env), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{env['BATCHGATE_PORT']}"
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
        time.sleep(0.1)
