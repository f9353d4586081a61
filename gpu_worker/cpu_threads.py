"""How a worker's compute threads use the CPU and the device: which thread may grow an OpenMP pool and
how many threads each gets (`CpuShare`), background engines niced or on a low-priority CUDA stream
(`bind_compute_thread`), and torch work on helper threads kept single-threaded. torch is imported only
inside the calls that need it, so the rules are tested without it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def _torch_set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


# CFS weights: nice 0 is 1024, +2 is 655: the background engine yields to the foreground one without
# being starved by every other runnable thread on the machine (at +5, 335, it was, in the e2e benchmark)
BACKGROUND_NICE = 2


def bind_compute_thread(device: Any, *, background: bool) -> str:
    """Called on a compute loop's own thread before it runs. Several engines of one model compete for one
    device: the engine of the shortest lanes runs at normal priority, the others in the background. On
    CUDA each engine gets a stream of its own (the foreground one at high priority), so their kernels
    overlap and the short lane's are scheduled first; on CPU the background threads are niced.
    Returns what was done, for the log."""
    if device.type == "cuda":
        import torch

        try:
            torch.cuda.synchronize(device)  # the caches were zero-filled on the default stream
            lo, hi = torch.cuda.Stream.priority_range()  # (lowest priority, highest priority)
            stream = torch.cuda.Stream(device=device, priority=lo if background else hi)
            torch.cuda.set_stream(stream)
            return f"cuda stream priority {lo if background else hi}"
        except (RuntimeError, AttributeError) as exc:  # an old driver or build: the default stream still works
            log.warning("no stream of its own for this engine", error=repr(exc))
            return "default cuda stream"
    if background:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (OSError, AttributeError) as exc:  # not Linux, or not permitted
            log.warning("could not lower the priority of a background engine", error=repr(exc))
            return "normal priority"
        return f"nice +{BACKGROUND_NICE}"
    return "normal priority"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads_per_engine(engines: int, configured: int = 0, cores: int | None = None) -> int:
    """torch threads for each of `engines` compute threads that all have work, sharing this process's CPUs."""
    if configured > 0:
        return configured
    return max(1, (cores or cpu_cores()) // max(1, engines))


def model_size(model: Any) -> int:
    """Parameters of a torch model (0 for anything else): the largest model's engine owns the CPU pool."""
    try:
        return sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError):
        return 0


def single_threaded(fn: Callable[..., Any], *args: Any) -> Any:
    """Run torch work on a helper thread (model loading, warm-up) without giving that thread an OpenMP
    pool: see `CpuShare` for why a second pool slows every engine."""
    import torch

    torch.set_num_threads(1)
    return fn(*args)


class CpuShare:
    """The process's cores among its CPU compute threads (an engine's own thread, or one that several
    engines of a model share: `gpu_worker.turns`), named by the caller, the owner first.

    torch's thread count is per calling thread, and GNU OpenMP keeps a pool of worker threads for
    every thread that ever ran a parallel region on more than one, for that thread's whole life.
    Once the pools hold more threads than there are cores, libgomp stops spinning between parallel
    regions and every region waits for its workers to be woken: on this repo's 2-core VM, a 1-row
    decode step on a helper thread took 13.9 ms on two threads beside a second pool, 10.2 ms on one
    thread, and 6.1 ms on two threads with no other pool (`scripts/step_costs.py --threads-check`,
    `docs/bench/threads_check.json`; `tests/unit/test_engines.py` checks the rule). So the pools must
    never outnumber the cores:

    - one compute thread, the *owner* (the worker names the largest model's first), may grow a pool;
    - every other one gets a fixed count, `cores // threads`;
    - the owner gets what those leave. If they run on one thread each (no pool of theirs ever
      exists), that is every core while they are idle and one core fewer per thread with work;
      otherwise it is the cores their pools leave, always.

    `configured` (`BATCHGATE_TORCH_THREADS`) fixes every thread's count instead."""

    def __init__(self, engines: list[str], configured: int = 0, cores: int | None = None,
                 set_threads: Callable[[int], None] | None = None) -> None:
        self._set_threads = set_threads or _torch_set_num_threads
        self.cores = cores or cpu_cores()
        self.owner = engines[0] if engines else ""
        self.fixed = configured if configured > 0 else None
        others = len(engines) - 1
        self.other = cpu_threads_per_engine(len(engines), 0, self.cores)
        self.owner_max = self.cores if self.other == 1 else max(1, self.cores - others * self.other)
        self._busy: dict[str, bool] = {}
        self._set: dict[str, int] = {}

    def threads(self, engine: str) -> int:
        """What `engine` should run on now (pure: reads the others' last reported state)."""
        if self.fixed is not None:
            return self.fixed
        if engine != self.owner:
            return self.other
        if self.other > 1:
            return self.owner_max
        busy = sum(1 for name, b in self._busy.items() if b and name != engine)
        return max(1, self.owner_max - busy)

    def report(self, engine: str, busy: bool) -> None:
        """From `engine`'s own thread, each iteration: whether it has work; sets its threads when it does."""
        self._busy[engine] = busy
        if not busy:
            return
        want = self.threads(engine)
        if self._set.get(engine) != want:
            self._set_threads(want)
            self._set[engine] = want
