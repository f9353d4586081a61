"""Engines taking turns on one compute thread: who computes when (fake runners, a fake clock)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from gpu_worker.commands import Add, Drain
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.model_loop import ModelLoop
from gpu_worker.outcomes import Outcome
from gpu_worker.scheduler import BACKGROUND_PREFILL_WAIT_S, BatchLimits, Scheduler
from gpu_worker.service_model import ServiceModel
from gpu_worker.turns import FOREGROUND_RECENT_S, SharedComputeThread, background_due
from tests.unit.test_model_loop import STEP_S, Clock, FakeRunner, req


@pytest.mark.parametrize(("since_last", "last_turn", "share", "due"), [
    (0.0, 0.0, 0.3, True),  # never ran: due at once
    (0.069, 0.03, 0.3, False),  # a 30 ms turn earns 70 ms of waiting at a 30% share
    (0.071, 0.03, 0.3, True),
    (0.029, 0.03, 0.5, False),  # half the time: as long as its turn
    (0.031, 0.03, 0.5, True),
    (0.0, 5.0, 1.0, True),  # a share of 1: always due
    (10.0, 1.0, 0.05, False),  # 5% of the time: 19 s between 1 s turns
])
def test_background_due(since_last: float, last_turn: float, share: float, due: bool) -> None:
    assert background_due(100.0 + since_last, 100.0, last_turn, share) is due


class LoggingRunner(FakeRunner):
    def __init__(self, clock: Clock, rows: int, name: str, log: list[str]) -> None:
        super().__init__(clock, rows)
        self.name, self.log = name, log

    def step(self, chunk_tokens: int = 0):
        self.log.append(self.name)
        return super().step(chunk_tokens)


def two_engines(share: float = 0.3):
    clock = Clock()
    steps: list[str] = []
    emitted: list = []
    lock = threading.Lock()

    def emit(items: list) -> None:
        with lock:
            emitted.extend(i for i in items if isinstance(i, Outcome))

    loops = []
    for name in ("short", "long"):
        runner = LoggingRunner(clock, 4, name, steps)
        sched = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 10_000),
                          service=ServiceModel(decode_s_per_token=STEP_S))
        loops.append(ModelLoop("m", runner, sched, mark_running=lambda rs: [True] * len(rs), emit=emit, clock=clock,
                               worker="w", idle_wait_s=0.05, engine=name))
    host = SharedComputeThread(loops, share=share, clock=clock)
    return host, loops, clock, steps, emitted


def run(host: SharedComputeThread, loops: list[ModelLoop], emitted: list, expected: int) -> None:
    host.start()
    deadline = time.monotonic() + 10
    while len(emitted) < expected and time.monotonic() < deadline:
        time.sleep(0.005)
    for lp in loops:
        lp.submit(Drain(0.0))
    assert host.join(10)
    assert len(emitted) == expected
    assert all(lp.stopped for lp in loops) and all(lp.crashed is None for lp in loops)


def test_the_first_engine_goes_first_and_the_others_keep_their_share() -> None:
    host, (short, long), clock, steps, emitted = two_engines(share=0.3)
    long.submit(Add([req(1, clock, new=20)], clock.t))
    short.submit(Add([req(2, clock, new=40)], clock.t))
    run(host, [short, long], emitted, 2)
    assert steps.count("short") == 40 and steps.count("long") == 20
    # while short work runs, a long step (10 ms) earns 10 x 0.7 / 0.3 = 23 ms of waiting: 3 short steps
    last_short = len(steps) - 1 - steps[::-1].index("short")
    while_both = steps[:last_short + 1]
    assert while_both[:5] == ["short", "long", "short", "short", "short"]
    gaps = [i for i, s in enumerate(while_both) if s == "long"]
    assert all(b - a == 4 for a, b in itertools.pairwise(gaps))
    # once the short request is done, the long one has the thread to itself
    assert steps[-1] == "long" and steps.index("short") == 0


def test_an_engine_alone_computes_every_round() -> None:
    host, (short, long), clock, steps, emitted = two_engines()
    long.submit(Add([req(1, clock, new=15)], clock.t))
    run(host, [short, long], emitted, 1)
    assert steps == ["long"] * 15


def test_a_crash_stops_every_engine_on_the_thread() -> None:
    host, (short, long), _, _, _ = two_engines()
    crashes: list[int] = []
    long._on_crash = lambda: crashes.append(1)

    def boom() -> dict:
        raise RuntimeError("the engine fell over")

    long.runner.remaining_tokens = boom  # type: ignore[method-assign]  (outside the step's own error handling)
    host.start()
    assert host.join(10)
    assert isinstance(long.crashed, RuntimeError) and short.crashed is None
    assert crashes == [1] and short.stopped and long.stopped


def test_a_yielding_turn_prefills_nothing_until_work_has_waited() -> None:
    _, (_, long), clock, _, _ = two_engines()
    long.submit(Add([req(1, clock, new=5), req(2, clock, new=5)], clock.t))
    long.yielding = True  # the first engine has rows running
    long._iterate(block=False)
    assert long.runner.started == []
    clock.t += BACKGROUND_PREFILL_WAIT_S
    long._iterate(block=False)
    assert long.runner.started == ["r1"]  # one row per turn, the longest-waiting first
    long.yielding = False  # the first engine went idle: everything that fits
    long.submit(Add([req(3, clock, new=5)], clock.t))
    long._iterate(block=False)
    assert long.runner.started == ["r1", "r2", "r3"]
    _, (short, _), clock2, _, _ = two_engines()  # the first engine is never held back
    short.submit(Add([req(i, clock2, new=5) for i in range(3)], clock2.t))
    short._iterate(block=False)
    assert len(short.runner.started) == 3



def test_the_other_engines_stay_in_the_background_a_while_after_the_first_goes_quiet() -> None:
    """A short request arriving in a lull between short rows must not wait out a long prompt's whole
    prefill: the other engines keep to small chunks for FOREGROUND_RECENT_S after the first engine's last
    running row; after that (no short work for that long, as while saturated work overflows to them) not."""
    host = two_engines()[0]
    assert host.foreground_recent(False, 0.0) is False  # never busy
    assert host.foreground_recent(True, 10.0) is True
    assert host.foreground_recent(False, 10.0 + FOREGROUND_RECENT_S - 0.01) is True
    assert host.foreground_recent(False, 10.0 + FOREGROUND_RECENT_S) is False
