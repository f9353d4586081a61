"""A model served by several engines: routing, hand-over by the real lane, cancel and drain to every engine
(fake runners and clock; no torch, no Redis)."""

from __future__ import annotations

import dataclasses

from gpu_worker.commands import Add
from gpu_worker.cpu_threads import CpuShare, cpu_threads_per_engine
from gpu_worker.engines import OVERFLOW_AFTER_S, ModelEngines
from gpu_worker.job import Job
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.model_loop import ModelLoop
from gpu_worker.outcomes import HandBack, Outcome
from gpu_worker.scheduler import BatchLimits, Scheduler
from gpu_worker.service_model import ServiceModel
from gpu_worker.sizing import engine_seq_len
from shared.config import BUILTIN_MODELS, ModelSpec
from shared.lanes import DEFAULT_LANES, LaneSpec, engine_groups
from shared.states import Status, Task
from tests.unit.test_model_loop import STEP_S, Clock, FakeRunner, req

SPEC = ModelSpec(name="m", task=Task.GENERATE, source="/x",
                 lanes=(LaneSpec("short", 20, engine="short"), LaneSpec("long", None)))


class LaneRunner(FakeRunner):
    """Files a request by its real size (max_new_tokens), whatever lane the gateway guessed."""

    def prepare(self, r, now: float) -> Job:
        item = super().prepare(r, now)
        item.lane = "short" if item.new_tokens <= 20 else "long"
        return item


def make_engines(clock: Clock, main_rows: int = 4):
    engines = ModelEngines(SPEC)
    emitted: list = []
    runners = {}
    groups = engine_groups(SPEC.lanes)
    for i, (engine, lanes) in enumerate(groups):
        runner = runners[engine] = LaneRunner(clock, main_rows if engine == "main" else 4)
        overflow = [LanePolicy(ln.name, 0.0) for _, earlier in groups[:i] for ln in earlier] if engine == "main" else []
        sched = Scheduler([LanePolicy(lane.name, 0.0) for lane in lanes], BatchLimits(8, 10_000),
                          service=ServiceModel(decode_s_per_token=STEP_S), overflow=overflow)
        engines.add(ModelLoop("m", runner, sched, mark_running=lambda rs: [True] * len(rs), emit=emitted.extend,
                              clock=clock, worker="w", idle_wait_s=0.0, engine=engine,
                              hand_over=engines.hand_over))
    return engines, runners, emitted


def run_all_until_idle(engines: ModelEngines, limit: int = 10_000) -> None:
    for _ in range(limit):
        for loop in engines:
            loop._iterate()
        if all(not lp.runner.busy and len(lp.scheduler) == 0 and lp._inbox.empty() for lp in engines):
            return
    raise AssertionError("engines did not go idle")


def succeeded(emitted) -> list[str]:
    return sorted(o.request.id for o in emitted if isinstance(o, Outcome) and o.result.status is Status.SUCCEEDED)


def test_each_lane_runs_on_its_own_engine():
    clock = Clock()
    engines, runners, emitted = make_engines(clock)
    short, long = req(1, clock, new=5), dataclasses.replace(req(2, clock, new=50), lane="long")
    engines.for_lane("short").submit(Add([short], clock.t))
    engines.for_lane("long").submit(Add([long], clock.t))
    run_all_until_idle(engines)
    assert succeeded(emitted) == ["r1", "r2"]
    assert runners["short"].started == ["r1"] and runners["main"].started == ["r2"]


def test_a_request_filed_under_the_wrong_lane_is_handed_to_its_engine():
    """The gateway's cheap estimate said short; the real size says long: the long lane's engine runs it,
    once, and the short engine never does."""
    clock = Clock()
    engines, runners, emitted = make_engines(clock)
    misfiled = req(1, clock, new=50)  # lane "short" as the gateway filed it
    engines.for_lane(misfiled.lane).submit(Add([misfiled], clock.t))
    run_all_until_idle(engines)
    assert succeeded(emitted) == ["r1"]
    assert runners["short"].started == [] and runners["main"].started == ["r1"]


def saturate_main(engines: ModelEngines, runners, clock: Clock, wait_s: float) -> None:
    """The main engine's rows busy with long requests and another long one waiting `wait_s`."""
    main = engines.for_lane("long")
    rows = runners["main"].max_rows
    main.submit(Add([dataclasses.replace(req(90 + i, clock, new=50, timeout=1e6), lane="long")
                     for i in range(rows + 1)], clock.t))
    main._iterate()
    assert len(runners["main"].running_ids()) == rows and len(main.scheduler) == 1
    clock.t += wait_s
    main.report._last = -1e9  # the next round refreshes its load snapshot
    main._iterate()


def test_while_the_last_engine_is_saturated_short_work_joins_its_batch():
    """Two forwards a step cost throughput; once the main engine has had work waiting OVERFLOW_AFTER_S, new
    short requests run in its one batch (started there, not on the short engine)."""
    clock = Clock()
    engines, runners, emitted = make_engines(clock, main_rows=2)
    saturate_main(engines, runners, clock, OVERFLOW_AFTER_S + 0.1)
    assert engines.saturated and engines.route("short") is engines.for_lane("long")
    engines.submit([req(1, clock, new=5)], clock.t)
    main = engines.for_lane("long")
    main.report._last = -1e9
    main._iterate()
    # while it holds the short lane's work, the main engine publishes that lane too (first: it starts first), so
    # admission counts its costs and its queue for short requests and the short queue ahead of longer ones
    assert next(iter(main.snapshot.lanes)) == "short" and main.snapshot.lanes["short"].waiting == 1
    run_all_until_idle(engines)
    assert "r1" in runners["main"].started and runners["short"].started == []
    assert "r1" in succeeded(emitted)
    # with none of the short lane's work left, the main engine no longer publishes that lane
    main.report._last = -1e9
    main._iterate()
    assert set(main.snapshot.lanes) == {"long"}


def test_short_work_keeps_its_own_engine_until_the_wait_is_long_enough():
    clock = Clock()
    engines, runners, _ = make_engines(clock, main_rows=1)
    saturate_main(engines, runners, clock, OVERFLOW_AFTER_S - 0.5)
    assert not engines.saturated and engines.route("short") is engines.for_lane("short")
    engines.submit([req(1, clock, new=5)], clock.t)
    for _ in range(20):
        for loop in engines:
            loop._iterate()
    assert runners["short"].started == ["r1"] and "r1" not in runners["main"].started


def test_a_hand_over_to_a_stopped_engine_goes_back_to_the_stream():
    clock = Clock()
    engines, _, emitted = make_engines(clock)
    engines.for_lane("long").stopped = True
    engines.for_lane("short").submit(Add([req(1, clock, new=50)], clock.t))
    engines.for_lane("short")._iterate()
    backs = [o for o in emitted if isinstance(o, HandBack)]
    assert [r.id for b in backs for r in b.requests] == ["r1"]


def test_cancel_and_drain_reach_every_engine():
    clock = Clock()
    engines, runners, emitted = make_engines(clock)
    a, b = req(1, clock, new=1000), req(2, clock, new=5)
    engines.for_lane("short").submit(Add([a, b], clock.t))  # a is handed over to the long engine
    for _ in range(3):
        for loop in engines:
            loop._iterate()
    assert "r1" in runners["main"].running_ids()
    engines.cancel("r1")
    engines.drain(clock.t)
    for _ in range(3):
        for loop in engines:
            loop._iterate()
    assert all(lp.stopped for lp in engines)
    cancelled = [o.request.id for o in emitted if isinstance(o, Outcome) and o.result.status is Status.CANCELLED]
    assert cancelled == ["r1"]


def test_engine_sequence_length_follows_its_lanes():
    spec = BUILTIN_MODELS["tiny-llama"]  # 2,048 + 256 tokens at most
    short, main = engine_groups((LaneSpec("short", 128, engine="short"), *DEFAULT_LANES[1:]))
    assert engine_seq_len(spec, short[1]) == 128
    assert engine_seq_len(spec, main[1]) == 2304  # the long lane is unbounded
    assert engine_seq_len(spec, (LaneSpec("a", 4096),)) == 2304


def test_cpu_threads_are_shared_between_engines():
    assert cpu_threads_per_engine(1, configured=3) == 3
    assert cpu_threads_per_engine(10_000) == 1
    assert cpu_threads_per_engine(1) >= cpu_threads_per_engine(2) >= 1


def test_cpu_share_gives_only_the_owner_a_pool_on_a_small_machine():
    share = CpuShare(["m/short", "m/main"], cores=2)
    assert (share.owner, share.other, share.owner_max) == ("m/short", 1, 2)
    assert share.threads("m/short") == 2  # nobody else has work: every core
    share._busy["m/main"] = True
    assert share.threads("m/short") == 1  # the other engine has work too: one core each
    assert share.threads("m/main") == 1  # never a pool of its own, busy or not
    share._busy["m/main"] = False
    assert share.threads("m/short") == 2
    assert share.threads("m/main") == 1
    assert CpuShare(["a", "b"], configured=3, cores=4).threads("b") == 3  # BATCHGATE_TORCH_THREADS wins


def test_cpu_share_never_lets_the_pools_outnumber_the_cores():
    for cores in range(1, 33):
        for n in range(1, 6):
            names = [f"e{i}" for i in range(n)]
            share = CpuShare(names, cores=cores)
            for busy in range(2 ** n):
                share._busy = {name: bool(busy >> i & 1) for i, name in enumerate(names)}
                counts = [share.threads(name) for name in names]
                # a pool, once grown, lives as long as its thread: count each at its largest
                largest = [max(share.threads(name), share.owner_max if name == share.owner else 0)
                           for name in names]
                assert sum(c for c in largest if c > 1) <= cores, (cores, n, counts)
                assert all(c >= 1 for c in counts)
                if busy == 2 ** n - 1 and cores >= n:  # all busy, enough cores: none oversubscribed
                    assert sum(counts) <= cores
    assert CpuShare(["only"], cores=16).threads("only") == 16
    big = CpuShare(["short", "main"], cores=16)
    assert (big.threads("short"), big.threads("main")) == (8, 8)


def test_long_rows_bound_only_the_engine_that_runs_the_first_lane_beside_others():
    """`long_rows` protects short rows in the forwards they share with longer work: the one-batch layout gets it
    when set, and with the short lane on an engine of its own neither engine does (the main engine's overflow
    lanes are the short lane's, not its own forwards' concern)."""
    from gpu_worker.assembly import build_scheduler

    class Rows:
        free_rows, fused = 16, False

    one_batch = ModelSpec(name="m", task=Task.GENERATE, source="/x")
    assert build_scheduler(one_batch, Rows()).long_rows is None  # off by default
    assert build_scheduler(dataclasses.replace(one_batch, long_rows=8), Rows()).long_rows == 8
    two = dataclasses.replace(SPEC, long_rows=8)
    (_, short), (_, main) = engine_groups(two.lanes)
    assert build_scheduler(two, Rows(), short).long_rows is None
    assert build_scheduler(two, Rows(), main, short).long_rows is None
    embed = ModelSpec(name="e", task=Task.EMBED, source="/x", long_rows=8)
    assert build_scheduler(embed, Rows()).long_rows is None  # an encoder's batch has no running rows
