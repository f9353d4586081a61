"""`batchgate worker`: run a worker process until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import sys
from typing import NoReturn

import structlog

from gpu_worker.devices import check_devices
from gpu_worker.worker import Worker
from shared.config import Settings
from shared.faults import Faults
from shared.startup_checks import start_metrics_server

log = structlog.get_logger(__name__)


async def _main(settings: Settings, drain_budget_s: float | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = Worker(settings, drain_budget_s=drain_budget_s, faults=Faults.from_environ())
    await worker.run(stop)


def run_worker(settings: Settings, *, metrics_host: str = "127.0.0.1", drain_budget_s: float | None = None) -> None:
    """Until SIGTERM/SIGINT. A model's device this host lacks, or a metrics port it cannot have, is a ConfigError
    before anything starts."""
    check_devices(settings.models)
    if settings.worker_metrics_port:
        start_metrics_server("BATCHGATE_WORKER_METRICS_PORT", settings.worker_metrics_port, metrics_host)
        log.info("worker metrics", url=f"http://{metrics_host}:{settings.worker_metrics_port}/metrics")
    try:
        import uvloop

        uvloop.run(_main(settings, drain_budget_s))
    except ImportError:
        asyncio.run(_main(settings, drain_budget_s))


def quick_exit(code: int) -> NoReturn:
    """End the process once the worker has stopped: the atexit handlers run and the output is flushed, but the
    interpreter's teardown of every module's objects (torch's, transformers') is skipped: it took 1.2-1.8 s after
    "worker stopped", a stop (a deploy, a scale-in, each test's worker) waited it out for nothing."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)
