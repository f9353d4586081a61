"""A preallocated, right-aligned KV cache for a running batch of sequences (torch only).

Layout per layer: keys/values `[rows, kv_heads, width, head_dim]`. Every running row ends at the
same column `end` (exclusive); row r holds its tokens in `[start[r], end)` and padding to the left.
A decode step writes column `end` for all rows at once (no torch.cat, no reallocation), and
attention reads only `[min(start), end + 1)`, so a short batch never attends over columns that no
row uses. New rows are prefilled straight into their own rows, right-aligned at `end`.

Invariants: rows `[0, n_rows)` are live; `start[r] <= end`; `end <= width`; every column a live
row can read holds finite values.

`keys` and `values` are views from cache row `base` on: the rows before it hold parked rows
(`gpu_worker.parked_rows`), which sit out the steps where they are; moving `base` parks or brings
back rows without copying their caches.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class SlotKVCache:
    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int, max_width: int) -> None:
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_rows = max_rows
        self.max_width = max_width
        self.rows_cap = 0
        self.width = 0
        self.base = 0  # the first cache row the running batch uses (the rows before it are parked)
        self.keys: list[torch.Tensor] = []  # per layer, rows [base, max_rows)
        self.values: list[torch.Tensor] = []
        self._all_keys: list[torch.Tensor] = []  # per layer, every row
        self._all_values: list[torch.Tensor] = []

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, max_rows: int, max_width: int) -> SlotKVCache:
        layers, kv_heads, head_dim = kv_shape(model)
        param = next(model.parameters())
        return cls(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=param.dtype, device=param.device,
                   max_rows=max_rows, max_width=max_width)

    @staticmethod
    def bytes_per_row(model: torch.nn.Module, max_seq_len: int) -> int:
        """Cache bytes one row of an engine for sequences up to `max_seq_len` can cost (its cache is twice as
        wide)."""
        layers, kv_heads, head_dim = kv_shape(model)
        return 2 * layers * kv_heads * head_dim * next(model.parameters()).element_size() * 2 * max_seq_len

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def allocate(self) -> None:
        """Allocate the whole cache up front: the memory budget is reserved at start, and serving
        never stalls on a growth copy. Zeros, never `empty`: when a longer row joins, older rows attend
        (masked) over columns they never wrote, and a masked NaN still poisons the weighted sum."""
        shape = (self.max_rows, self.kv_heads, self.max_width, self.head_dim)
        self._all_keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self._all_values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.rows_cap, self.width = self.max_rows, self.max_width
        self.set_base(0)

    def set_base(self, base: int) -> None:
        """The running batch's rows start at cache row `base` (views: nothing is copied)."""
        if not 0 <= base < self.max_rows:
            raise ValueError(f"base {base} outside [0, {self.max_rows})")
        self.base = base
        self.keys = [k[base:] for k in self._all_keys]
        self.values = [v[base:] for v in self._all_values]

    def swap_rows(self, a: int, b: int, lo: int, hi: int) -> None:
        """Swap cache rows `a` and `b` (absolute rows: parked ones included) over columns [lo, hi)."""
        if a == b or hi <= lo:
            return
        for k, v in zip(self._all_keys, self._all_values, strict=True):
            k[[a, b], :, lo:hi] = k[[b, a], :, lo:hi]
            v[[a, b], :, lo:hi] = v[[b, a], :, lo:hi]

    def move_row(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Copy row `src` into row `dst` over columns [lo, hi) (swap-remove of a finished row)."""
        for k, v in zip(self.keys, self.values, strict=True):
            k[dst, :, lo:hi] = k[src, :, lo:hi]
            v[dst, :, lo:hi] = v[src, :, lo:hi]

    def copy_span(self, src: int, src_lo: int, dst: int, dst_lo: int, length: int) -> None:
        """Copy `length` columns of row `src` from `src_lo` to row `dst` at `dst_lo` (the spans may overlap)."""
        if (src, src_lo) == (dst, dst_lo) or length <= 0:
            return
        for k, v in zip(self.keys, self.values, strict=True):
            if src != dst:  # different rows never overlap: no copy of the copy
                k[dst, :, dst_lo: dst_lo + length] = k[src, :, src_lo: src_lo + length]
                v[dst, :, dst_lo: dst_lo + length] = v[src, :, src_lo: src_lo + length]
            else:
                k[dst, :, dst_lo: dst_lo + length] = k[src, :, src_lo: src_lo + length].clone()
                v[dst, :, dst_lo: dst_lo + length] = v[src, :, src_lo: src_lo + length].clone()

    def shift_columns(self, rows: int, lo: int, hi: int, offset: int) -> None:
        """Move columns [lo, hi) of rows [0, rows) by `offset` (either direction)."""
        if offset == 0 or rows == 0 or hi <= lo:
            return
        for k, v in zip(self.keys, self.values, strict=True):
            k[:rows, :, lo + offset: hi + offset] = k[:rows, :, lo:hi].clone()
            v[:rows, :, lo + offset: hi + offset] = v[:rows, :, lo:hi].clone()

    def window(self, rows: slice, write_lo: int, write_hi: int, read_lo: int) -> CacheWindow:
        return CacheWindow(self, rows, write_lo, write_hi, read_lo)


def text_config(model: torch.nn.Module) -> Any:
    """The config of a causal LM's text model (a multimodal model's text part; the config itself otherwise)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a causal LM's cache, from its (text) config."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


class CacheWindow(Cache):
    """What one forward sees: new keys/values go to columns [write_lo, write_hi) of `rows`; attention
    reads [read_lo, write_hi). Implements the part of transformers' `Cache` that decoder layers call."""

    def __init__(self, cache: SlotKVCache, rows: slice, write_lo: int, write_hi: int, read_lo: int) -> None:
        # Cache.__init__ wants layer classes; this window owns no storage of its own.
        self.layers = []
        self._cache = cache
        self._rows = rows
        self._write = (write_lo, write_hi)
        self._read_lo = read_lo

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self._write
        k = self._cache.keys[layer_idx]
        v = self._cache.values[layer_idx]
        k[self._rows, :, lo:hi] = key_states
        v[self._rows, :, lo:hi] = value_states
        return k[self._rows, :, self._read_lo:hi], v[self._rows, :, self._read_lo:hi]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write[1] - self._read_lo

    @property
    def is_compileable(self) -> bool:
        return False
