"""The engine benchmark's sliding-window mode (`bench_engine.py --window`): what a sliding-window layer's cache
costs when it keeps only its window (`gpu_worker/window_kv.py`) against keeping every column, as before.

Two seeded models of the benchmark model's sizes: Mistral with a window on every layer, and Qwen2 with two full
layers and six windowed ones (the hybrid local/global shape of Gemma 2/3 and Cohere 2). For each, two engines
serve the same rows (prompts longer than the window, then decode steps): one as the worker builds it (rings for
the windowed layers) and one with every column kept. Reported: the cache bytes per row and the rows a KV budget
then holds, the median decode step, and whether the greedy tokens of the two engines are equal.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

ARCHS = ("mistral", "hybrid")


def model_for(arch: str, base: Any, window: int) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = base.config
    sizes = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                 num_key_value_heads=c.num_key_value_heads, max_position_embeddings=8192, sliding_window=window,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if arch == "mistral":
        cfg = AutoConfig.for_model("mistral", **sizes)
    else:  # two full layers, the rest windowed
        cfg = AutoConfig.for_model("qwen2", **sizes, use_sliding_window=True, max_window_layers=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).eval()


@contextlib.contextmanager
def every_column_kept() -> Iterator[None]:
    """Engines built inside keep every column of every layer (the engine before rings)."""
    from gpu_worker import window_kv

    real = window_kv.Rings.of

    def none(layout: Any, layer_types: Any, layers: int, max_seq_len: int) -> window_kv.Rings:
        return window_kv.Rings({}, [0] * layers, single=not layout.by_type)

    window_kv.Rings.of = none  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        window_kv.Rings.of = real  # type: ignore[method-assign]


def serve(model: Any, *, rows: int, prompt: int, steps: int, max_seq_len: int, seed: int) -> dict[str, Any]:
    import torch

    from gpu_worker.engine import GenerationEngine
    from gpu_worker.sequences import GenSpec

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    engine = GenerationEngine(model, max_rows=rows, max_seq_len=max_seq_len)
    specs = [GenSpec(id=f"r{i}", prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt - 3 * i)),
                     max_new_tokens=steps + 1) for i in range(rows)]
    for spec in specs:
        engine.prefill([spec])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    tokens = {r.spec.id: list(r.tokens) for r in engine.rows}
    cache_bytes = sum(k.numel() * k.element_size() * 2 for k in engine.cache.keys)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"decode_step_ms": statistics.median(times[3:]) * 1000, "tokens": tokens,
            "kv_bytes_per_row": cache_bytes // rows}  # as allocated


def run(base: Any, arch: str, *, window: int = 256, rows: int = 8, prompt: int = 1536, steps: int = 40,
        max_seq_len: int = 2048, kv_budget_tokens: int = 65536, seed: int = 0) -> dict[str, Any]:
    from gpu_worker.kv_cache import SlotKVCache
    from gpu_worker.sizing import engine_rows
    from gpu_worker.window_kv import Rings

    model = model_for(arch, base, window)
    kw = dict(rows=rows, prompt=prompt, steps=steps, max_seq_len=max_seq_len, seed=seed)
    ring = serve(model, **kw)
    with every_column_kept():
        full = serve(model, **kw)
    rings = Rings.for_model(model, max_seq_len).per_layer
    per_token = SlotKVCache.bytes_per_row(model, max_seq_len) // (2 * max_seq_len)
    budget = kv_budget_tokens * per_token
    return {
        "arch": arch, "window": window, "max_seq_len": max_seq_len, "ring_layers": sum(1 for w in rings if w),
        "layers": len(rings),
        "kv_bytes_per_row_ring": ring["kv_bytes_per_row"], "kv_bytes_per_row_full": full["kv_bytes_per_row"],
        "kv_row_ratio": ring["kv_bytes_per_row"] / full["kv_bytes_per_row"],
        "rows_in_budget_ring": engine_rows(10**6, budget, SlotKVCache.bytes_per_row(model, max_seq_len, rings)),
        "rows_in_budget_full": engine_rows(10**6, budget, SlotKVCache.bytes_per_row(model, max_seq_len)),
        "decode_step_ms_ring": ring["decode_step_ms"], "decode_step_ms_full": full["decode_step_ms"],
        "step_ratio": ring["decode_step_ms"] / full["decode_step_ms"],
        "tokens_equal": ring["tokens"] == full["tokens"],
    }
