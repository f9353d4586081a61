"""A generation engine's warm-up: the first-call imports and kernels happen before serving, not on a request, and
its costs are timed for what stands in until requests are measured (`CostPrior`, `ServiceTracker.seed`). No torch
imported here: the engine's own calls."""

from __future__ import annotations

import time
from typing import Any

from gpu_worker.sequences import EngineStats, GenSpec
from gpu_worker.service_model import CostPrior

# the timed prompts (tokens): a line through two sizes is a prefill's fixed part and cost per token
WARM_PROMPTS = (4, 64)
WARM_NEW_TOKENS = 3


def timed_generations(engine: Any, vocab: int, longest: int) -> CostPrior:
    """Three short generations on `engine` (a `GenerationEngine`, idle): an untimed first, then a short and a longer
    prompt timed (prefill, fastest decode step); `longest`: the longest sequence it may run."""
    timed_generation(engine, vocab, WARM_PROMPTS[0])
    short = timed_generation(engine, vocab, WARM_PROMPTS[0])
    longer = min(WARM_PROMPTS[1], longest - WARM_NEW_TOKENS)
    long = timed_generation(engine, vocab, longer) if longer > WARM_PROMPTS[0] else short
    engine.stats = EngineStats()  # what it served counts from here
    return CostPrior.through(short[:2], long[:2], step_s=min(short[2], long[2]))


def timed_generation(engine: Any, vocab: int, prompt_tokens: int) -> tuple[int, float, float]:
    """(prompt tokens, prefill seconds, fastest decode step) of one warm-up generation, run to its end."""
    ids = tuple(1 + i % max(1, vocab - 1) for i in range(prompt_tokens))
    t0 = time.perf_counter()
    engine.prefill([GenSpec(id="warm-up", prompt_ids=ids, max_new_tokens=WARM_NEW_TOKENS)])
    prefill_s, steps = time.perf_counter() - t0, []
    while engine.running:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return prompt_tokens, prefill_s, min(steps, default=0.0)
