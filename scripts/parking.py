"""The engine benchmark's parking mode (`bench_engine.py --park`): what it costs to set batch rows aside beside
an interactive row, and to bring them back (`GenerationEngine.hold_back`, `gpu_worker/parked_rows.py`).

--rows rows (prompts 64-256 tokens) decode a while; then all but one are held back (the pattern of a CPU when an
interactive request arrives beside a full batch), the one left steps a few times, and all come back. Timed: the
hold, the release, and a decode step with every row and with the one. An interactive request that arrives pays
the hold before its first step. Only the engine's public API is used, so the same mode measures an older engine
too (`PYTHONPATH=<its checkout> python scripts/bench_engine.py --park`).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any


def run(model: Any, *, rows: int = 60, seed: int = 0) -> dict[str, float]:
    from gpu_worker.engine import GenerationEngine
    from gpu_worker.sequences import GenSpec

    rng = random.Random(seed)
    engine = GenerationEngine(model, max_rows=rows + 4, max_seq_len=512)
    vocab = model.config.vocab_size
    specs = [GenSpec(id=f"b{i}", prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(rng.randint(64, 256))),
                     max_new_tokens=200) for i in range(rows)]
    for i in range(0, rows, 10):
        engine.prefill(specs[i:i + 10])
    full, alone = [], []
    for _ in range(20):
        t = time.perf_counter()
        engine.step()
        full.append(time.perf_counter() - t)
    t = time.perf_counter()
    engine.hold_back({s.id for s in specs[1:]})
    hold = time.perf_counter() - t
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - t)
    t = time.perf_counter()
    engine.hold_back(set())
    release = time.perf_counter() - t
    return {"hold_ms": hold * 1000, "release_ms": release * 1000,
            "step_all_rows_ms": statistics.median(full) * 1000, "step_one_row_ms": statistics.median(alone) * 1000}
