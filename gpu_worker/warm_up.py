"""A generation engine's warm-up: the first-call imports and kernels happen before serving, not on a request, and
its costs are timed for what stands in until requests are measured (`CostPrior`, `ServiceTracker.seed`). No torch
imported here: the engine's own calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpu_worker.sequences import EngineStats, GenSpec
from gpu_worker.service_model import CostPrior

# the timed prompts (tokens): a line through two sizes is a prefill's fixed part and cost per token
WARM_PROMPTS = (4, 64)
WARM_NEW_TOKENS = 3
# rows of the timed batch: a line through its step and the one-row step is what each running row adds to a step
# (a CPU's grows with the rows, a GPU's barely), which admission prices a burst's rows at from the first request
WARM_ROWS = 8
# times that batch is run, its fastest step kept: noise only adds time, and one slow sample of it (a busy machine)
# would read as a step that is all cost per row, with no fixed part
WARM_BATCHES = 3


def timed_generations(engine: Any, vocab: int, longest: int,
                      clock: Callable[[], float] = time.perf_counter) -> CostPrior:
    """Short generations on `engine` (a `GenerationEngine`, idle): an untimed first, then a short and a longer
    prompt timed (prefill, fastest decode step), then `WARM_ROWS` short ones side by side, `WARM_BATCHES` times (the
    fastest step of that many rows); `longest`: the longest sequence it may run."""
    timed_generation(engine, vocab, WARM_PROMPTS[0], clock=clock)
    short = timed_generation(engine, vocab, WARM_PROMPTS[0], clock=clock)
    longer = min(WARM_PROMPTS[1], longest - WARM_NEW_TOKENS)
    long = timed_generation(engine, vocab, longer, clock=clock) if longer > WARM_PROMPTS[0] else short
    one_row = min(short[2], long[2])
    rows = min(WARM_ROWS, engine.max_rows)
    per_row = 0.0
    if rows > 1:
        many = min(timed_generation(engine, vocab, WARM_PROMPTS[0], rows=rows, clock=clock)[2]
                   for _ in range(WARM_BATCHES))
        per_row = max(0.0, (many - one_row) / (rows - 1))
    engine.stats = EngineStats()  # what it served counts from here
    return CostPrior.through(short[:2], long[:2], step_s=max(0.0, one_row - per_row), step_per_row_s=per_row)


def timed_generation(engine: Any, vocab: int, prompt_tokens: int, rows: int = 1,
                     clock: Callable[[], float] = time.perf_counter) -> tuple[int, float, float]:
    """(prompt tokens, prefill seconds, fastest decode step) of one warm-up generation of `rows` rows alike, run to
    its end."""
    ids = tuple(1 + i % max(1, vocab - 1) for i in range(prompt_tokens))
    t0 = clock()
    engine.prefill([GenSpec(id=f"warm-up-{i}", prompt_ids=ids, max_new_tokens=WARM_NEW_TOKENS) for i in range(rows)])
    prefill_s, steps = clock() - t0, []
    while engine.running:
        t0 = clock()
        engine.step()
        steps.append(clock() - t0)
    return prompt_tokens, prefill_s, min(steps, default=0.0)
