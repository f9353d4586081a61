"""Several engines of one CPU model on one compute thread, taking turns forward by forward.

Why one thread: GNU OpenMP slows every parallel region once a process's thread pools outnumber its
cores (see `gpu_worker.cpu_threads.CpuShare`), so on a small machine only one thread may compute on every
core. Engines on threads of their own must then split the cores, and each runs at a fraction of the
machine's speed. On one thread every forward has every core, and the engines take turns instead.

Who goes when (`background_due`, pure): the first engine (the shortest lanes) computes whenever it
has work. Another engine computes when the first has no running rows, or, while it has, once it has
waited long enough since its last turn that it still gets `BACKGROUND_SHARE` of the thread's time;
such a turn prefills at most `BACKGROUND_CHUNK_TOKENS` (new prompts, and long ones in chunks), any
other turn within `FOREGROUND_RECENT_S` of the first engine's last running row at most
`BACKGROUND_IDLE_CHUNK_TOKENS` (so a short request arriving in a lull waits out no big prefill; with
chunked prefill off, a yielding turn starts no prefill unless its work has waited a while:
`Scheduler._rows_while_yielding`; the bounds: `gpu_worker.prefill_budget`). So short work waits at
most one decode step and one small chunk of long work between two of its tokens, and long work never
starves. While the model is saturated the first engine gets no new work (`gpu_worker.engines`). This
plays the part CUDA stream priorities play on a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from gpu_worker.model_loop import IDLE_WAIT_S

if TYPE_CHECKING:
    from gpu_worker.model_loop import ModelLoop

log = structlog.get_logger(__name__)

# While the first engine has running rows, another engine still gets this share of the thread's time.
BACKGROUND_SHARE = 0.15
# The first engine counts as active for this long after its last running row (see the module docstring);
# after that (no short work for a while, e.g. while a saturated model's work overflows to the last engine)
# the others prefill in chunks of the configured size again.
FOREGROUND_RECENT_S = 2.0


def background_due(now: float, last_end: float, last_turn_s: float, share: float = BACKGROUND_SHARE) -> bool:
    """Whether an engine that waits beside a busy first engine may take its turn now: it has waited so
    long since its last turn (which took `last_turn_s`) that its turns make up `share` of the time."""
    if share >= 1.0:
        return True
    return now - last_end >= last_turn_s * (1.0 - share) / max(share, 1e-9)


class SharedComputeThread:
    """Runs the compute loops of one model's engines on a single thread (the loops stay as they are:
    each plans, gates, prefills and steps in its `_iterate`; this thread decides whose turn it is)."""

    def __init__(self, loops: list[ModelLoop], *, share: float = BACKGROUND_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.loops = loops
        self.share = share
        self._clock = clock
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_busy_at = float("-inf")
        self._last_end = [0.0] * len(loops)
        self._last_turn = [0.0] * len(loops)
        self.on_work: Callable[[bool], None] | None = None  # told each round whether any engine has work
        for lp in loops:
            lp.attach(self)

    @property
    def name(self) -> str:
        return f"{self.loops[0].name}/{'+'.join(lp.engine for lp in self.loops)}"

    def wake(self) -> None:
        self._wake.set()

    def foreground_recent(self, busy: bool, now: float) -> bool:
        """Note whether the first engine has rows running now; True while it had some in the last
        `FOREGROUND_RECENT_S`."""
        if busy:
            self._first_busy_at = now
        return now - self._first_busy_at < FOREGROUND_RECENT_S

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"model-loop-{self.name}", daemon=True)
            self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        current = self.loops[0]
        try:
            first = self.loops[0]
            if first._bind_thread is not None:
                log.info("compute loop started", model=first.name, engines=[lp.engine for lp in self.loops],
                         lanes=[lane for lp in self.loops for lane in lp.scheduler.queues],
                         thread=first._bind_thread(), shared=True)
            while not all(lp.stopped for lp in self.loops):
                self._wake.clear()
                waits: list[float] = []
                worked = False
                if self.on_work is not None:
                    self.on_work(any(lp.has_work for lp in self.loops if not lp.stopped))
                first_busy = not first.stopped and first.runner.busy
                first_recent = self.foreground_recent(first_busy, self._clock())
                for i, lp in enumerate(self.loops):
                    if lp.stopped:
                        continue
                    now = self._clock()
                    if (i > 0 and first_busy and lp.has_work
                            and not background_due(now, self._last_end[i], self._last_turn[i], self.share)):
                        worked = True  # it has work and will be due shortly: no sleeping
                        continue
                    current = lp
                    lp.yielding = i > 0 and first_busy
                    lp.background = i > 0 and first_recent
                    wait = lp._iterate(block=False)
                    end = self._clock()
                    self._last_end[i], self._last_turn[i] = end, end - now
                    if wait is None:
                        worked = True
                    else:
                        waits.append(wait)
                if not worked:
                    self._wake.wait(min(waits, default=IDLE_WAIT_S))
        except BaseException as exc:  # the worker notices and exits non-zero; entries get reclaimed
            current.crashed = exc
            log.exception("model loop crashed", model=current.name, engine=current.engine)
            current._on_crash()
        finally:
            for lp in self.loops:
                lp.stopped = True
