"""Builds a worker's compute side from its settings: each model loaded once, its lanes grouped into
engines (one `ModelLoop` per group, each with its runner and scheduler), CPU cores shared among the
compute threads. The I/O side (`gpu_worker.worker`) only sees the resulting `ModelEngines` per model.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import structlog

from gpu_worker.cpu_threads import CpuShare, bind_compute_thread, model_size, single_threaded
from gpu_worker.echo_runner import EchoRunner
from gpu_worker.engines import ModelEngines
from gpu_worker.model_loop import ModelLoop
from gpu_worker.outcomes import Emitted
from gpu_worker.runner import Runner
from gpu_worker.scheduler import BatchLimits, LanePolicy, Scheduler
from gpu_worker.service_model import CostPrior
from gpu_worker.sizing import engine_seq_len, size_engines
from gpu_worker.turns import SharedComputeThread
from shared.config import ModelSpec, Settings
from shared.faults import Faults
from shared.lanes import LaneSpec, engine_groups
from shared.messages import InferenceRequest
from shared.states import Task

log = structlog.get_logger(__name__)


def build_runners(loaded: Any, worker: str, faults: Faults,
                  groups: list[tuple[str, tuple[LaneSpec, ...]]]) -> list[Runner]:
    """One runner per engine group, all over the one loaded model (torch is imported here, not before: a worker
    serving only echo models never loads it)."""
    spec: ModelSpec = loaded.spec
    if spec.task is Task.EMBED:
        from gpu_worker.embed_runner import EmbedRunner

        return [EmbedRunner(loaded, worker, faults=faults) for _ in groups]
    from gpu_worker.exactness import verify_exact
    from gpu_worker.generate_runner import GenerateRunner, model_context

    # served exactly or refused, before any request reaches it; and whether chunks may ride in decode steps
    fused = verify_exact(loaded.model, spec.name)
    context = model_context(loaded.model)
    if context is not None and context < spec.max_seq_len:  # requests past it are refused, one by one
        log.warning("the model's context is shorter than its limits allow (max_input_tokens + max_new_tokens, the "
                    "model file's or the defaults): requests past it are refused",
                    model=spec.name, context=context, max_input_tokens=spec.max_input_tokens,
                    max_new_tokens=spec.max_new_tokens)
    seq_lens = [min(engine_seq_len(spec, lanes), context or spec.max_seq_len) for _, lanes in groups]
    rows = size_engines(loaded, seq_lens)
    return [GenerateRunner(loaded, worker, max_rows=r, max_seq_len=n, faults=faults, fused=fused)
            for r, n in zip(rows, seq_lens, strict=True)]


def build_scheduler(spec: ModelSpec, runner: Runner, lanes: tuple[LaneSpec, ...] | None = None,
                    overflow: tuple[LaneSpec, ...] = (), prior: CostPrior | None = None) -> Scheduler:
    """`overflow`: other engines' lanes this engine also takes while the model is saturated (see
    `gpu_worker.engines`); `prior`: the runner's costs before any is measured (its `warm_up`'s)."""
    # lane shares are of a running batch's rows; an encoder's batch ends with its forward, so it has none
    rows = runner.free_rows if spec.task is Task.GENERATE else None
    lanes = lanes or spec.lanes
    # `long_rows` protects the first lane's rows in the forwards they share with longer lanes: only in the engine
    # that runs the first lane beside others
    shared_forwards = rows is not None and len(lanes) > 1 and lanes[0] == spec.lanes[0] and not overflow

    def policies(specs: tuple[LaneSpec, ...]) -> list[LanePolicy]:
        return [LanePolicy(lane.name, lane.window_ms / 1000, lane.max_share) for lane in specs]

    scheduler = Scheduler(policies(lanes), BatchLimits(spec.max_batch_size, spec.max_batch_tokens),
                          deadline_aware=spec.deadline_aware, total_rows=rows, overflow=policies(overflow),
                          fused=runner.fused, long_rows=(spec.long_rows or None) if shared_forwards else None,
                          chunk_tokens=(spec.prefill_chunk_tokens or None) if spec.task is Task.GENERATE else None)
    if prior is not None:
        scheduler.tracker.seed(prior)
        scheduler.refresh_estimates()
    return scheduler


def echo_engines(spec: ModelSpec, worker: str, faults: Faults, groups: list[tuple[str, tuple[LaneSpec, ...]]], *,
                 mark_running: Callable[[list[InferenceRequest]], list[bool] | None],
                 emit: Callable[[list[Emitted]], None], on_crash: Callable[[], None]) -> ModelEngines:
    """An echo model's engines (`gpu_worker.echo_runner`): the same loops, lanes and scheduler as a model's, each
    engine on a thread of its own, `max_running` rows each."""
    engines = ModelEngines(spec)
    for i, (engine, lanes) in enumerate(groups):
        runner = EchoRunner(spec, worker, max_rows=spec.max_running, faults=faults)
        overflow = tuple(ln for _, earlier in groups[:i] for ln in earlier) if i == len(groups) - 1 else ()
        engines.add(ModelLoop(spec.name, runner, build_scheduler(spec, runner, lanes, overflow, runner.warm_up()),
                              mark_running=mark_running, emit=emit, on_crash=on_crash, worker=worker, faults=faults,
                              engine=engine, bind_thread=lambda: "echo: no model",
                              hand_over=engines.hand_over if len(groups) > 1 else None))
    return engines


async def load_engines(settings: Settings, *, worker: str, faults: Faults,
                       mark_running: Callable[[list[InferenceRequest]], list[bool] | None],
                       emit: Callable[[list[Emitted]], None], on_crash: Callable[[], None],
                       loader: Callable[[ModelSpec], Any] | None = None) -> dict[str, ModelEngines]:
    """Load every configured model and build its engines (not started). `mark_running` marks requests running
    (False: already terminal; None: cannot tell), `emit` takes outcomes, `on_crash` is told of a dead loop."""
    from gpu_worker import models

    out: dict[str, ModelEngines] = {}
    cpu: list[tuple[int, str, ModelLoop | SharedComputeThread]] = []  # (model size, name, compute thread)
    for spec in settings.models:
        groups = engine_groups(spec.lanes)
        if spec.echo:  # no model: no loading, no torch, no CPU share
            out[spec.name] = echo_engines(spec, worker, faults, groups, mark_running=mark_running, emit=emit,
                                          on_crash=on_crash)
            continue
        if loader is not None:
            loaded = await asyncio.to_thread(single_threaded, loader, spec)
        else:
            loaded = await asyncio.to_thread(single_threaded, models.load, spec, settings.model_cache_dir)
        runners = build_runners(loaded, worker, faults, groups)
        engines = out[spec.name] = ModelEngines(spec)
        for i, ((engine, lanes), runner) in enumerate(zip(groups, runners, strict=True)):
            prior = await asyncio.to_thread(single_threaded, runner.warm_up)
            bind = functools.partial(bind_compute_thread, loaded.device, background=i > 0)
            # the last engine's rows hold any request: it takes the other engines' lanes when saturated
            overflow = tuple(ln for _, earlier in groups[:i] for ln in earlier) if i == len(groups) - 1 else ()
            scheduler = build_scheduler(spec, runner, lanes, overflow, prior)
            engines.add(ModelLoop(spec.name, runner, scheduler, mark_running=mark_running,
                                  emit=emit, on_crash=on_crash, worker=worker, faults=faults, engine=engine,
                                  bind_thread=bind, hand_over=engines.hand_over if len(groups) > 1 else None))
        if loaded.device.type == "cpu":
            size = model_size(loaded.model)
            if len(engines.loops) > 1 and settings.cpu_engines == "shared":
                host = SharedComputeThread(engines.loops)
                cpu.append((size, host.name, host))
            else:
                cpu.extend((size, f"{lp.name}/{lp.engine}", lp) for lp in engines)
    if cpu:  # the process's cores among its CPU compute threads (see CpuShare); the largest model's first
        cpu.sort(key=lambda c: -c[0])  # (stable) may grow the one thread pool
        share = CpuShare([name for _, name, _ in cpu], settings.torch_threads)
        for _, name, compute in cpu:
            compute.on_work = functools.partial(share.report, name)
        log.info("cpu threads per compute thread", threads=[name for _, name, _ in cpu], cores=share.cores,
                 owner=share.owner, owner_max=share.fixed or share.owner_max, others=share.fixed or share.other)
    return out
