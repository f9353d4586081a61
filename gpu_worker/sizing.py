"""How many rows each generation engine gets: the KV cache budget (from config, else from the device's
free memory) split among a model's engines, each row sized for its engine's longest sequence, so load
can never exhaust memory. The rules are pure; torch is imported only where a device is asked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import structlog

from shared.config import ModelSpec
from shared.errors import ConfigError
from shared.lanes import LaneSpec

log = structlog.get_logger(__name__)


def kv_budget_bytes(spec_budget_tokens: int | None, bytes_per_token: int, device: Any) -> int:
    """The KV cache memory this worker may use: from config, else sized from the device."""
    if spec_budget_tokens is not None:
        return spec_budget_tokens * bytes_per_token
    if device.type == "cuda":
        import torch  # only a CUDA worker gets here; the pure sizing rules import no torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.7)  # the rest: activations, logits, allocator slack
    return min(int(available_memory() * 0.25), 8 << 30)


def available_memory() -> int:
    """Bytes the system can give without swapping: MemAvailable (free memory plus the page cache it can drop);
    MemFree alone, which a full page cache keeps small, would size the cache to a few rows."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def engine_rows(max_running: int, budget_bytes: int, bytes_per_row: int) -> int:
    """Rows of the running batch that fit the budget (each row may use the cache's full width)."""
    return max(0, min(max_running, budget_bytes // max(1, bytes_per_row)))


def engine_seq_len(spec: ModelSpec, lanes: Sequence[LaneSpec]) -> int:
    """Longest sequence an engine serving `lanes` can be given: the model's limit, or less when its lanes
    are all bounded (a request is filed under a lane by prompt + max_new_tokens, so the bound holds)."""
    bounds = [lane.max_tokens for lane in lanes]
    if None in bounds:
        return spec.max_seq_len
    return min(spec.max_seq_len, max(b for b in bounds if b is not None))


def size_engines(loaded: Any, seq_lens: Sequence[int]) -> list[int]:
    """Rows for each of a model's engines (one per engine group), so load can never exhaust memory: the
    model's KV budget is split evenly between its engines, each row sized for its engine's longest sequence."""
    from gpu_worker.kv_cache import SlotKVCache
    from gpu_worker.window_kv import Rings

    spec = loaded.spec
    per_token = SlotKVCache.bytes_per_row(loaded.model, spec.max_seq_len) // (2 * spec.max_seq_len)
    budget = kv_budget_bytes(spec.kv_budget_tokens, per_token, loaded.device) // max(1, len(seq_lens))
    sizes = []
    for seq_len in seq_lens:  # a sliding-window layer keeps its window's columns only (`gpu_worker.window_kv`)
        per_row = SlotKVCache.bytes_per_row(loaded.model, seq_len, Rings.for_model(loaded.model, seq_len).per_layer)
        rows = engine_rows(spec.max_running, budget, per_row)
        if rows < 1:
            raise ConfigError(f"model {spec.name}: a KV budget of {budget} bytes per engine holds no sequence of "
                              f"{seq_len} tokens ({per_row} bytes); raise kv_budget_tokens or lower the limits")
        log.info("engine sized", model=spec.name, rows=rows, max_seq_len=seq_len,
                 kv_cache_mib=round(rows * per_row / 2**20, 1), budget_mib=round(budget / 2**20, 1))
        sizes.append(rows)
    return sizes
