"""The compute loop's decisions end to end, with a fake runner and a fake clock (no torch, no Redis)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY

from gpu_worker import background_rows
from gpu_worker.commands import Add, Cancel, Drain, Release
from gpu_worker.job import Job
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.model_loop import ModelLoop
from gpu_worker.outcomes import Ack, HandBack, Outcome, result_for
from gpu_worker.scheduler import BatchLimits, Scheduler
from gpu_worker.service_model import ServiceModel
from shared.messages import InferenceRequest
from shared.states import FinishReason, Priority, Status, Task

STEP_S = 0.01


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Row:
    req: InferenceRequest
    left: int


class FakeRunner:
    """Generates `max_new_tokens` tokens, one per step; each step costs STEP_S of fake time (plus `per_row_s` per
    row it advances); rows held back (`hold_back`) sit the steps out."""

    def __init__(self, clock: Clock, rows: int, per_row_s: float = 0.0) -> None:
        self.clock = clock
        self.rows: dict[str, Row] = {}
        self.max_rows = rows
        self.per_row_s = per_row_s  # what each stepped row adds to a step (a CPU's cost)
        self.held: set[str] = set()
        self.stepped: list[set[str]] = []  # the rows each step advanced
        self.started: list[str] = []

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self.rows)

    def running_ids(self) -> list[str]:
        return list(self.rows)

    def engine_stats(self):
        return None

    def warm_up(self) -> None:
        return None

    def take_deltas(self) -> list:
        return []

    def hold_back(self, ids: frozenset[str]) -> None:
        self.held = set(ids)

    def remaining_tokens(self) -> dict[str, int]:
        return {rid: row.left for rid, row in self.rows.items()}

    def remove(self, ids: set[str], reason: FinishReason) -> list[Outcome]:
        status = {FinishReason.DEADLINE: Status.EXPIRED, FinishReason.CANCELLED: Status.CANCELLED}.get(
            reason, Status.FAILED)
        out = []
        for rid in set(ids) & set(self.rows):
            row = self.rows.pop(rid)
            out.append(Outcome(row.req, result_for(row.req, status, worker="w", now=self.clock.t, reason=reason)))
        return out

    def prepare(self, req: InferenceRequest, now: float) -> Job:
        n = req.params["max_new_tokens"]
        return Job(id=req.id, lane=req.lane, rank=req.priority.rank, deadline=req.deadline_ms / 1000,
                   arrived=now, tokens=n + 1, prompt_tokens=1, new_tokens=n, request=req)

    def start(self, batch: list[Job], now: float) -> list[Outcome]:
        for job in batch:
            self.started.append(job.id)
            self.rows[job.id] = Row(job.req, job.new_tokens)
        return []

    chunking = False
    chunk_left = 0
    fused = False
    last_chunk = (0, 0.0)

    def begin_chunked(self, job: Job, now: float) -> list[Outcome]:
        return self.start([job], now)

    def step(self, chunk_tokens: int = 0) -> list[Outcome]:
        stepping = [rid for rid in self.rows if rid not in self.held]
        self.stepped.append(set(stepping))
        self.clock.t += STEP_S + self.per_row_s * len(stepping)
        done = []
        for rid in stepping:
            row = self.rows[rid]
            row.left -= 1
            if row.left <= 0:
                del self.rows[rid]
                done.append(Outcome(row.req, result_for(row.req, Status.SUCCEEDED, worker="w", now=self.clock.t,
                                                        reason=FinishReason.LENGTH)))
        return done


def req(i: int, clock: Clock, *, new: int = 10, timeout: float = 60.0, priority=Priority.INTERACTIVE):
    now_ms = int(clock.t * 1000)
    return InferenceRequest(id=f"r{i}", tenant="t", model="m", task=Task.GENERATE, input={"input_ids": [1]},
                            params={"max_new_tokens": new}, lane="short", priority=priority, created_ms=now_ms,
                            deadline_ms=now_ms + int(timeout * 1000), est_tokens=new + 1)


def make(rows: int = 2, mark_running=None, deadline_aware: bool = True, per_row_s: float = 0.0):
    clock = Clock()
    runner = FakeRunner(clock, rows, per_row_s)
    sched = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 10_000), deadline_aware=deadline_aware,
                      service=ServiceModel(decode_s_per_token=STEP_S))
    emitted: list = []
    loop = ModelLoop("m", runner, sched, mark_running=mark_running or (lambda rs: [True] * len(rs)),
                     emit=emitted.extend, clock=clock, worker="w", idle_wait_s=0.0)
    return loop, runner, clock, emitted


def run_until_idle(loop: ModelLoop, runner: FakeRunner, limit: int = 10_000) -> None:
    for _ in range(limit):
        loop._iterate()
        if not runner.busy and len(loop.scheduler) == 0:
            return
    raise AssertionError("loop did not go idle")


def finished(emitted, status=Status.SUCCEEDED):
    return [o.request.id for o in emitted if isinstance(o, Outcome) and o.result.status is status]


def test_requests_run_and_finish():
    loop, runner, clock, emitted = make()
    loop.submit(Add([req(i, clock) for i in range(5)], clock.t))
    run_until_idle(loop, runner)
    assert sorted(finished(emitted)) == [f"r{i}" for i in range(5)]


def test_gate_drops_requests_already_terminal():
    loop, runner, clock, emitted = make(mark_running=lambda rs: [r.id != "r1" for r in rs])
    loop.submit(Add([req(0, clock), req(1, clock)], clock.t))
    run_until_idle(loop, runner)
    assert "r1" not in runner.started
    assert [o.request.id for o in emitted if isinstance(o, Ack)] == ["r1"]


def test_expired_while_queued_is_never_started():
    loop, runner, clock, emitted = make(rows=1)
    loop.submit(Add([req(0, clock, new=50)], clock.t))
    loop._iterate()
    loop.submit(Add([req(1, clock, new=5, timeout=0.2)], clock.t))
    run_until_idle(loop, runner)
    assert runner.started == ["r0"]  # r1 waited for the only row and its deadline passed first
    assert finished(emitted, Status.EXPIRED) == ["r1"]


def test_cancel_of_a_queued_request():
    loop, runner, clock, emitted = make(rows=1)
    loop.submit(Add([req(0, clock, new=20), req(1, clock)], clock.t))
    loop._iterate()
    loop.submit(Cancel({"r1"}))
    run_until_idle(loop, runner)
    assert "r1" not in runner.started
    assert [o.request.id for o in emitted if isinstance(o, Ack)] == ["r1"]


def test_batch_priority_rows_are_preempted_for_interactive_work_out_of_slack():
    loop, runner, clock, emitted = make(rows=2)
    loop.submit(Add([req(i, clock, new=100, priority=Priority.BATCH) for i in range(2)], clock.t))
    loop._iterate()
    assert sorted(runner.rows) == ["r0", "r1"]
    # needs 10 steps = 0.1 s; deadline in 0.5 s; batch rows would free up only after 1 s
    loop.submit(Add([req(9, clock, new=10, timeout=0.5)], clock.t))
    run_until_idle(loop, runner)
    ok = [o for o in emitted if isinstance(o, Outcome) and o.request.id == "r9"]
    assert ok and ok[0].result.status is Status.SUCCEEDED
    assert ok[0].result.finished_ms <= ok[0].request.deadline_ms
    # the preempted batch request was re-queued and still finished
    assert sorted(finished(emitted)) == ["r0", "r1", "r9"]


def test_batch_rows_sit_out_while_an_interactive_row_decodes_and_lose_nothing():
    loop, runner, clock, emitted = make(rows=32, per_row_s=0.002)  # every row adds to a step, as on a CPU
    loop.submit(Add([req(i, clock, new=200, priority=Priority.BATCH) for i in range(20)], clock.t))
    for _ in range(20):  # they join 8 a round; the steps' cost by rows gets measured
        loop._iterate()
    assert runner.stepped[-1] == {f"r{i}" for i in range(20)}
    t0 = clock.t
    loop.submit(Add([req(99, clock, new=10)], clock.t))
    while "r99" not in finished(emitted):
        loop._iterate()
    beside = [s for s in runner.stepped if "r99" in s]
    assert len(beside) == 10 and all(s == {"r99"} for s in beside)  # 12 ms a step, where 20 more rows cost 40
    assert clock.t - t0 < 10 * 0.0125
    done_at = clock.t
    loop._iterate()
    # right after it, batch rows alone keep steps within two one-row steps (the next interactive request may come)
    assert runner.stepped[-1] < {f"r{i}" for i in range(20)} and len(runner.stepped[-1]) >= 1
    while clock.t - done_at < background_rows.LINGER_S:
        loop._iterate()
    loop._iterate()
    assert runner.stepped[-1] == {f"r{i}" for i in range(20)}  # back, all of them
    run_until_idle(loop, runner)
    assert sorted(finished(emitted)) == sorted([f"r{i}" for i in range(20)] + ["r99"])
    assert not loop.scheduler.running


def test_batch_work_leaves_rows_for_interactive_work():
    loop, runner, clock, _ = make(rows=32)
    loop.submit(Add([req(i, clock, new=200, priority=Priority.BATCH) for i in range(40)], clock.t))
    for _ in range(10):
        loop._iterate()
    assert len(runner.rows) == 30  # 2 of 32 rows stay free of batch work
    loop.submit(Add([req(99, clock, new=10)], clock.t))
    loop._iterate()
    assert "r99" in runner.rows  # a row at once: no preemption, no wait


def test_interactive_never_preempts_interactive():
    loop, runner, clock, emitted = make(rows=1)
    loop.submit(Add([req(0, clock, new=100)], clock.t))
    loop._iterate()
    loop.submit(Add([req(9, clock, new=10, timeout=0.5)], clock.t))
    run_until_idle(loop, runner)
    assert finished(emitted) == ["r0"] and finished(emitted, Status.EXPIRED) == ["r9"]


def test_fifo_baseline_computes_expired_work():
    loop, runner, clock, _emitted = make(rows=1, deadline_aware=False)
    loop.submit(Add([req(0, clock, new=50)], clock.t))
    loop._iterate()
    loop.submit(Add([req(1, clock, new=5, timeout=0.2)], clock.t))
    run_until_idle(loop, runner)
    assert runner.started == ["r0", "r1"]


def test_drain_hands_back_what_it_cannot_finish():
    loop, _runner, clock, emitted = make(rows=1)
    loop.submit(Add([req(0, clock, new=1000), req(1, clock)], clock.t))
    loop._iterate()
    loop.submit(Drain(clock.t + 0.05))
    for _ in range(100):
        if loop.stopped:
            break
        loop._iterate()
    assert loop.stopped
    backs = [o for o in emitted if isinstance(o, HandBack)]
    assert [r.id for r in backs[0].requests] == ["r1"]  # queued work went back at once
    assert sorted(r.id for b in backs for r in b.requests) == ["r0", "r1"]


def test_a_running_row_that_cannot_finish_leaves_early():
    loop, runner, clock, emitted = make(rows=2)
    loop.submit(Add([req(0, clock, new=100, timeout=0.5)], clock.t))  # 100 steps of 10 ms: needs 1 s
    for _ in range(5):
        loop._iterate()  # the loop measures its token interval while it runs
    run_until_idle(loop, runner)
    (out,) = [o for o in emitted if isinstance(o, Outcome)]
    assert out.result.status is Status.EXPIRED and clock.t < 1000.5  # left before reaching the deadline


def test_a_batch_the_gate_cannot_confirm_is_requeued_not_computed():
    calls = {"n": 0}

    def flaky(reqs):
        calls["n"] += 1
        return None if calls["n"] == 1 else [True] * len(reqs)

    loop, runner, clock, emitted = make(mark_running=flaky)
    loop.submit(Add([req(0, clock)], clock.t))
    loop._iterate()
    assert runner.started == [] and len(loop.scheduler) == 1
    clock.t += 1.0  # after the retry pause
    run_until_idle(loop, runner)
    assert runner.started == ["r0"] and finished(emitted) == ["r0"]


def test_a_failing_decode_step_fails_its_rows_not_the_loop():
    loop, runner, clock, emitted = make(rows=2)
    loop.submit(Add([req(0, clock), req(1, clock)], clock.t))
    loop._iterate()
    runner.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))  # type: ignore[method-assign]
    loop._iterate()
    assert sorted(finished(emitted, Status.FAILED)) == ["r0", "r1"] and not loop.stopped


def test_no_row_joins_when_it_would_push_a_running_row_past_its_deadline():
    """Under deadline pressure the loop admits only as many rows as keep every running row within its
    deadline at the measured step time (more rows, slower steps): nothing is started only to be evicted."""
    loop, runner, clock, emitted = make(rows=8)
    for rows in (1, 2, 4, 8):
        loop.tracker.observe_step(rows, 0.01 * rows)  # a step costs 10 ms per row
    for rows in (1, 2, 4, 8):
        loop.tracker.observe_step(rows, 0.01 * rows)
    tight = req(0, clock, new=10, timeout=0.45)  # 10 tokens in 0.45 s: at most 4 rows (40 ms a token)
    loop.submit(Add([tight], clock.t))
    loop._iterate()
    assert runner.started == ["r0"]
    assert loop.scheduler._deadline_room(clock.t, runner.remaining_tokens(), runner.free_rows) == 3
    loop.submit(Add([req(i, clock, new=10) for i in range(1, 8)], clock.t))
    loop._iterate()
    assert len(runner.rows) == 4  # three joined; four more wait for the tight one to finish
    run_until_idle(loop, runner)
    assert sorted(finished(emitted)) == sorted(f"r{i}" for i in range(8))


def test_without_deadline_pressure_every_free_row_is_used():
    loop, runner, clock, _ = make(rows=8)
    for rows in (1, 2, 4, 8, 1, 2, 4, 8):
        loop.tracker.observe_step(rows, 0.01 * rows)
    loop.submit(Add([req(i, clock, new=10, timeout=600) for i in range(8)], clock.t))
    loop._iterate()
    assert len(runner.rows) == 8


def test_rows_freed_by_a_step_take_queued_work_without_waiting_for_a_command():
    loop, runner, clock, _ = make(rows=1)
    loop.submit(Add([req(1, clock, new=2), req(2, clock, new=2)], clock.t))
    assert loop._iterate(block=False) is None  # r1 starts and steps; r2 waits for the row
    # r1 finishes in this round's step: the next round must come at once (it used to idle up to 1 s)
    assert loop._iterate(block=False) is None and not runner.busy and runner.started == ["r1"]
    loop._iterate(block=False)
    assert runner.started == ["r1", "r2"]


def test_batch_work_held_back_for_interactive_rows_starts_as_soon_as_they_end():
    """A batch-priority request queued while an interactive row decodes waits for it (on a CPU a row beside it
    slows it), but not a moment longer: the round whose step ends the last interactive row must not wait for a
    command (it used to idle up to 1 s, and a batch request with a few seconds to its deadline then expired)."""
    loop, runner, clock, emitted = make(rows=8, per_row_s=0.002)
    loop.submit(Add([req(0, clock, new=30)], clock.t))
    for _ in range(25):  # the step's cost by rows gets measured meanwhile
        loop._iterate(block=False)
    loop.submit(Add([req(1, clock, new=5, timeout=3.0, priority=Priority.BATCH)], clock.t))
    while "r0" not in finished(emitted):
        assert loop._iterate(block=False) is None
        assert "r1" not in runner.started or "r0" in finished(emitted)
    waits = []
    while "r1" not in runner.started:
        waits.append(loop._iterate(block=False))
        assert len(waits) < 5
    assert all(w is None for w in waits), waits  # no idle wait between r0's end and r1's start
    run_until_idle(loop, runner)
    assert "r1" in finished(emitted)


def test_the_published_load_places_a_new_request_where_the_worker_will_start_it():
    """The snapshot admission reads (`gpu_worker.load_outlook`): the waiting requests' (rank, deadline) keys in the
    order they start, when each running row ends (its tokens left at the forecast step), and the running
    batch-priority rows an interactive request may take."""
    loop, runner, clock, _ = make(rows=2)
    loop.submit(Add([req(0, clock, new=10, timeout=10.0, priority=Priority.BATCH), req(1, clock, new=200)], clock.t))
    loop._iterate()  # both start: the only two rows
    waiting = [req(i, clock, timeout=t, priority=Priority.BATCH) for i, t in ((2, 30.0), (3, 20.0), (4, 15.0))]
    loop.submit(Add(waiting, clock.t))
    loop.report._last = -1e9  # the next round refreshes its load snapshot
    loop._iterate()
    snap = loop.snapshot
    short = snap.lanes["short"]
    key = {r.id: int(r.deadline_ms / 1000 * 1000) for r in waiting}
    assert short.waiting == 3 and short.order == ((1, key["r4"]), (1, key["r3"]), (1, key["r2"]))  # by deadline
    step_ms = loop.scheduler.tracker.forecast_step_seconds(2) * 1000
    left = runner.remaining_tokens()
    assert short.frees_ms == tuple(sorted(int(left[rid] * step_ms) for rid in ("r0", "r1")))
    assert snap.preemptible == 1


def handed_to_peers() -> float:
    return REGISTRY.get_sample_value("batchgate_handed_to_peers_total", {"model": "m"}) or 0.0


def test_a_release_hands_the_most_urgent_waiting_work_to_an_idle_worker_once():
    loop, runner, clock, emitted = make(rows=2)
    loop.submit(Add([req(i, clock, new=1000, timeout=60.0 + i) for i in range(8)], clock.t))
    loop._iterate()  # 2 start, 6 wait
    before = handed_to_peers()
    loop.submit(Release(frozenset({"short"}), -2, 2))  # another worker's engine has its 2 rows free, nothing waiting
    loop._iterate()
    assert handed_to_peers() - before == 4  # counted
    backs = [r for o in emitted if isinstance(o, HandBack) for r in o.requests]
    assert [r.id for r in backs] == ["r2", "r3", "r4", "r5"]  # 6 against 2 free: 4 go, the ones due first
    assert {r.moved for r in backs} == {1}  # they are not moved again
    assert sorted(j.id for q in loop.scheduler.queues.values() for j in q.items()) == ["r6", "r7"]
    assert sorted(runner.started) == ["r0", "r1"]


def test_no_release_while_draining_nor_for_lanes_the_other_does_not_serve():
    loop, _runner, clock, emitted = make(rows=1)
    loop.submit(Add([req(i, clock, new=1000) for i in range(4)], clock.t))
    loop._iterate()
    loop.submit(Release(frozenset({"long"}), -8, 8))
    loop._iterate()
    assert not [o for o in emitted if isinstance(o, HandBack)]
    loop.submit(Drain(clock.t + 100))
    loop.submit(Release(frozenset({"short"}), -8, 8))
    loop._iterate()
    backs = [o for o in emitted if isinstance(o, HandBack)]
    assert len(backs) == 1 and sorted(r.id for r in backs[0].requests) == ["r1", "r2", "r3"]  # the drain's, once


def test_a_preempted_stream_that_expires_while_queued_keeps_what_its_caller_was_sent():
    """A batch-priority stream preempted for interactive work, then expired while queued again (its deadline could
    no longer be met): it ended `expired` with no output, "not computed", counted as expired before compute, though
    its caller had been sent tokens; now its output is those tokens, as a deadline reached mid-decode keeps them."""
    import dataclasses

    from gpu_worker.echo_runner import EchoRunner, decode_tokens
    from gpu_worker.outcomes import Delta
    from shared.config import ModelSpec

    clock = Clock()

    def sleep(s: float) -> None:
        clock.t += s

    spec = ModelSpec(name="m", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64, max_new_tokens=200,
                     step_ms=10).validate()
    runner = EchoRunner(spec, "w", max_rows=1, clock=clock, sleep=sleep)
    sched = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 10_000), deadline_aware=True,
                      service=ServiceModel(decode_s_per_token=STEP_S))
    emitted: list = []
    loop = ModelLoop("m", runner, sched, mark_running=lambda rs: [True] * len(rs), emit=emitted.extend, clock=clock,
                     worker="w", idle_wait_s=0.0)
    before = REGISTRY.get_sample_value("batchgate_expired_before_compute_total", {"model": "m", "lane": "short"}) or 0
    stream = dataclasses.replace(req(0, clock, new=100, timeout=1.2, priority=Priority.BATCH), stream=True,
                                 input={"prompt": "abc"})
    loop.submit(Add([stream], clock.t))
    for _ in range(20):
        loop._iterate()
    loop.submit(Add([req(9, clock, new=30, timeout=0.45)], clock.t))  # out of slack behind 80 more tokens: preempts
    run_until_idle(loop, runner)  # type: ignore[arg-type]
    sent = [t for d in emitted if isinstance(d, Delta) and d.request.id == "r0" for t in d.delta.token_ids]
    (end,) = [o for o in emitted if isinstance(o, Outcome) and o.request.id == "r0"]
    assert finished(emitted) == ["r9"] and len(sent) >= 15
    assert end.result.status is Status.EXPIRED and end.result.finish_reason is FinishReason.DEADLINE
    assert end.result.output is not None and end.result.output["token_ids"] == sent  # what the caller was sent
    assert end.result.output["text"] == decode_tokens(sent) and "partial output kept" in end.result.error.message
    after = REGISTRY.get_sample_value("batchgate_expired_before_compute_total", {"model": "m", "lane": "short"}) or 0
    assert after == before  # it was computed: not an expiry before compute

