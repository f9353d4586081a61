"""A model's engines in one worker: one compute loop per engine group of its lanes.

Lanes that name the same `engine` share a running batch; each engine is its own `ModelLoop` (thread,
scheduler over its lanes, runner with its own KV cache) over the one loaded model. Requests are routed
by the lane the gateway filed them under; an engine that finds, with the real tokenizer, that a request
belongs to another engine's lane hands it over. Cancellations and drains go to every engine.

The shortest lanes' engine runs in the foreground; the others run in the background: a lower-priority
CUDA stream, or on CPU turns on one shared compute thread (`gpu_worker.turns`; a niced thread of their
own with `BATCHGATE_CPU_ENGINES=parallel`). See docs/scheduling.md for why and what it measured.

Overflow: a forward of its own for the short lane costs throughput (two smaller forwards do less per
second than one that carries every row), which only matters once the model is saturated. So while the
last engine (the one whose rows hold any request) has had work waiting `OVERFLOW_AFTER_S`, new requests
of the other engines' lanes go to it too, and it runs them in its one batch, its scheduler still
starting the shortest lanes first; the other engines drain and leave it the whole device. Once its
queue clears, each lane's requests go back to their own engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from gpu_worker.commands import Add, Adopt, Cancel, Drain
from gpu_worker.job import Job
from gpu_worker.load_report import Snapshot
from gpu_worker.model_loop import ModelLoop
from gpu_worker.outcomes import HandBack
from shared.config import ModelSpec
from shared.messages import InferenceRequest, LaneStat, LaneStats

T = TypeVar("T")

# The last engine has had a request waiting this long: the model is saturated, and every lane's new work
# joins its batch (see the module's docstring). Long enough that a long prompt waiting out a foreground
# engine's busy moment does not count; short enough that a backlog is met within a few seconds.
OVERFLOW_AFTER_S = 4.0


@dataclass
class ModelEngines:
    spec: ModelSpec
    loops: list[ModelLoop] = field(default_factory=list)
    _by_lane: dict[str, ModelLoop] = field(default_factory=dict)

    def add(self, loop: ModelLoop) -> None:
        self.loops.append(loop)
        for lane in loop.scheduler.own_lanes:
            self._by_lane[lane] = loop

    def __iter__(self) -> Iterator[ModelLoop]:
        return iter(self.loops)

    def for_lane(self, lane: str) -> ModelLoop:
        """The engine serving `lane` (an unknown lane name, from a config change under a queued request,
        goes to the engine of the last lane, as the scheduler files it under its last lane)."""
        return self._by_lane.get(lane) or self.loops[-1]

    @property
    def saturated(self) -> bool:
        """The last engine has had work waiting `OVERFLOW_AFTER_S` (as of its last load snapshot)."""
        last = self.loops[-1]
        return len(self.loops) > 1 and last.snapshot.oldest_wait_s >= OVERFLOW_AFTER_S

    def route(self, lane: str) -> ModelLoop:
        """The engine a request of `lane` goes to now: its own, or the last engine's batch while the model is
        saturated (if that engine takes the lane)."""
        loop = self.for_lane(lane)
        last = self.loops[-1]
        if loop is not last and lane in last.scheduler.queues and self.saturated:
            return last
        return loop

    def split(self, items: Iterable[T], lane: Callable[[T], str]) -> list[tuple[ModelLoop, list[T]]]:
        """`items` grouped by the engine serving each one's lane, in engine order, empty groups left out."""
        groups: list[list[T]] = [[] for _ in self.loops]
        for item in items:
            groups[self.loops.index(self.route(lane(item)))].append(item)
        return [(loop, group) for loop, group in zip(self.loops, groups, strict=True) if group]

    def hand_over(self, items: list[Job]) -> None:
        """From an engine's thread: prepared requests whose real lane another engine serves."""
        for loop, mine in self.split(items, lambda p: p.lane):
            if loop.stopped:  # it has handed its work back already: this goes back to the stream too
                loop.emit([HandBack([job.req for job in mine])])
            else:
                loop.submit(Adopt(mine))

    def submit(self, requests: list[InferenceRequest], now: float) -> None:
        """Requests read from the model's streams, each to the engine serving the lane it was filed under."""
        for loop, reqs in self.split(requests, lambda r: r.lane):
            loop.submit(Add(reqs, now))

    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every engine's loop to end (after a drain); True when all have."""
        return all([loop.join(timeout) for loop in self.loops])

    def lane_stats(self, worker: str) -> dict[str, LaneStats]:
        """Each engine's load figures for admission control, by the stats-hash field it is published under
        (the worker's name, or worker/engine when the model has several engines); engines that have not
        measured anything yet are left out."""
        out: dict[str, LaneStats] = {}
        for loop in self.loops:
            if loop.snapshot.at:
                out[self.stats_field(worker, loop.engine)] = lane_stats(self.spec, worker, loop.snapshot)
        return out

    def stats_fields(self, worker: str) -> list[str]:
        return [self.stats_field(worker, loop.engine) for loop in self.loops]

    def stats_field(self, worker: str, engine: str) -> str:
        return worker if len(self.loops) == 1 else f"{worker}/{engine}"

    def cancel(self, request_id: str) -> None:
        for loop in self.loops:
            loop.submit(Cancel({request_id}))

    def drain(self, until: float) -> None:
        for loop in self.loops:
            loop.submit(Drain(until))

    @property
    def crashed(self) -> list[str]:
        return [f"{lp.name}/{lp.engine}: {lp.crashed!r}" for lp in self.loops if lp.crashed is not None]

    def model_calls(self) -> dict[str, int]:
        """How often each request reached the model, over all engines (tests and debugging)."""
        calls: dict[str, int] = {}
        for loop in self.loops:
            for rid, n in getattr(loop.runner, "model_calls", {}).items():
                calls[rid] = calls.get(rid, 0) + n
        return calls


def lane_stats(spec: ModelSpec, worker: str, snap: Snapshot) -> LaneStats:
    return LaneStats(
        model=spec.name, worker=worker, at_ms=int(snap.at * 1000), max_rows=snap.max_rows,
        free_rows=snap.free_rows, deadline_aware=spec.deadline_aware, prefill_fixed_ms=snap.prefill_fixed_ms,
        prefill_ms_per_token=snap.prefill_ms_per_token, decode_ms_per_step=snap.decode_ms_per_step,
        decode_ms_per_row=snap.decode_ms_per_row, preemptible=snap.preemptible,
        lanes=tuple(LaneStat(lane, load.waiting, load.running, load.completed_rps, load.est_wait_ms, load.order,
                             load.frees_ms) for lane, load in snap.lanes.items()),
    )
