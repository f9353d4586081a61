"""A preallocated, right-aligned KV cache for a running batch of sequences (torch only).

Layout per layer: keys/values `[rows, kv_heads, width, head_dim]`. Every running row ends at the
same column `end` (exclusive); row r holds its tokens in `[start[r], end)` and padding to the left.
A decode step writes column `end` for all rows at once (no torch.cat, no reallocation), and
attention reads only `[min(start), end + 1)`, so a short batch never attends over columns that no
row uses. New rows are prefilled straight into their own rows, right-aligned at `end`.

Invariants: rows `[0, n_rows)` are live; `start[r] <= end`; `end <= width`; every column a live
row can read holds finite values.

A sliding-window layer can keep a ring of its window's columns instead (`rings`, see
`gpu_worker.window_kv`): absolute column c at c mod W; the column operations below keep that mapping.

`keys` and `values` are views from cache row `base` on: the rows before it hold parked rows
(`gpu_worker.parked_rows`), which sit out the steps where they are; moving `base` parks or brings
back rows without copying their caches.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache


class SlotKVCache:
    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int, max_width: int, rings: list[int] | None = None) -> None:
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_rows = max_rows
        self.max_width = max_width
        # per layer: 0 keeps every column; W > 0 keeps a ring of W columns (a sliding window of W)
        self.rings = list(rings) if rings is not None else [0] * layers
        if len(self.rings) != layers or any(not 0 <= w <= max_width for w in self.rings):
            raise ValueError(f"rings {self.rings} for {layers} layers of width {max_width}")
        self.rows_cap = 0
        self.width = 0
        self.base = 0  # the first cache row the running batch uses (the rows before it are parked)
        self.keys: list[torch.Tensor] = []  # per layer, rows [base, max_rows)
        self.values: list[torch.Tensor] = []
        self._all_keys: list[torch.Tensor] = []  # per layer, every row
        self._all_values: list[torch.Tensor] = []

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, max_rows: int, max_width: int,
                  rings: list[int] | None = None) -> SlotKVCache:
        layers, kv_heads, head_dim = kv_shape(model)
        param = next(model.parameters())
        return cls(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=param.dtype, device=param.device,
                   max_rows=max_rows, max_width=max_width, rings=rings)

    @staticmethod
    def bytes_per_row(model: torch.nn.Module, max_seq_len: int, rings: list[int] | None = None) -> int:
        """Cache bytes one row of an engine for sequences up to `max_seq_len` can cost (its cache is twice as
        wide, but a ring layer's is its window)."""
        layers, kv_heads, head_dim = kv_shape(model)
        columns = sum(w or 2 * max_seq_len for w in (rings or [0] * layers))
        return 2 * kv_heads * head_dim * next(model.parameters()).element_size() * columns

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def allocate(self) -> None:
        """Allocate the whole cache up front: the memory budget is reserved at start, and serving
        never stalls on a growth copy. Zeros, never `empty`: when a longer row joins, older rows attend
        (masked) over columns they never wrote, and a masked NaN still poisons the weighted sum."""
        shapes = [(self.max_rows, self.kv_heads, w or self.max_width, self.head_dim) for w in self.rings]
        self._all_keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        self._all_values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
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
        for k, v, ring in zip(self._all_keys, self._all_values, self.rings, strict=True):
            cols = slice(None) if ring else slice(lo, hi)
            k[[a, b], :, cols] = k[[b, a], :, cols]
            v[[a, b], :, cols] = v[[b, a], :, cols]

    def move_row(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Copy row `src` into row `dst` over columns [lo, hi) (swap-remove of a finished row)."""
        for k, v, ring in zip(self.keys, self.values, self.rings, strict=True):
            cols = slice(None) if ring else slice(lo, hi)
            k[dst, :, cols] = k[src, :, cols]
            v[dst, :, cols] = v[src, :, cols]

    def copy_span(self, src: int, src_lo: int, dst: int, dst_lo: int, length: int) -> None:
        """Copy `length` columns of row `src` from `src_lo` to row `dst` at `dst_lo` (the spans may overlap)."""
        if (src, src_lo) == (dst, dst_lo) or length <= 0:
            return
        for k, v, ring in zip(self.keys, self.values, self.rings, strict=True):
            if ring:  # the last `ring` columns are all a ring holds (advanced indexing reads a copy first)
                src_cols = self.ring_columns(src_lo + length - min(length, ring), src_lo + length, ring)
                dst_cols = self.ring_columns(dst_lo + length - min(length, ring), dst_lo + length, ring)
                k[dst, :, dst_cols] = k[src, :, src_cols]
                v[dst, :, dst_cols] = v[src, :, src_cols]
            elif src != dst:  # different rows never overlap: no copy of the copy
                k[dst, :, dst_lo: dst_lo + length] = k[src, :, src_lo: src_lo + length]
                v[dst, :, dst_lo: dst_lo + length] = v[src, :, src_lo: src_lo + length]
            else:
                k[dst, :, dst_lo: dst_lo + length] = k[src, :, src_lo: src_lo + length].clone()
                v[dst, :, dst_lo: dst_lo + length] = v[src, :, src_lo: src_lo + length].clone()

    def shift_columns(self, rows: int, lo: int, hi: int, offset: int) -> None:
        """Move columns [lo, hi) of rows [0, rows) by `offset` (either direction)."""
        if offset == 0 or rows == 0 or hi <= lo:
            return
        for k, v, ring in zip(self.keys, self.values, self.rings, strict=True):
            if ring:  # relabelling every column by `offset` turns the ring
                if offset % ring:
                    k[:rows] = torch.roll(k[:rows], offset % ring, dims=2)
                    v[:rows] = torch.roll(v[:rows], offset % ring, dims=2)
                continue
            k[:rows, :, lo + offset: hi + offset] = k[:rows, :, lo:hi].clone()
            v[:rows, :, lo + offset: hi + offset] = v[:rows, :, lo:hi].clone()

    def ring_columns(self, lo: int, hi: int, ring: int) -> torch.Tensor:
        """Where absolute columns [lo, hi) sit in a ring of `ring` columns (`hi - lo <= ring`)."""
        return torch.arange(lo, hi, device=self.device) % ring

    def window(self, rows: slice, write_lo: int, write_hi: int, read_lo: int, *,
               ring_order: bool = False) -> CacheWindow:
        """A forward's view: see `CacheWindow`. `ring_order`: a decode step (one new column), whose ring layers
        read what `ring_read` gives (the whole ring as stored, once the span covers it: `window_kv`)."""
        return CacheWindow(self, rows, write_lo, write_hi, read_lo, ring_order)


def text_config(model: torch.nn.Module) -> Any:
    """The config of a causal LM's text model (a multimodal model's text part; the config itself otherwise)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name a model's forward takes its cache by: `cache` (transformers >= 5.2x; `past_key_values` is
    deprecated there, removed in 5.40), else `past_key_values` (older releases, models not renamed yet)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a causal LM's cache, from its (text) config."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


class CacheWindow(Cache):
    """What one forward sees: new keys/values go to columns [write_lo, write_hi) of `rows`; attention
    reads [read_lo, write_hi). Implements the part of transformers' `Cache` that decoder layers call."""

    def __init__(self, cache: SlotKVCache, rows: slice, write_lo: int, write_hi: int, read_lo: int,
                 ring_order: bool = False) -> None:
        # Cache.__init__ wants layer classes; this window owns no storage of its own.
        self.layers = []
        self._cache = cache
        self._rows = rows
        self._write = (write_lo, write_hi)
        self._read_lo = read_lo
        self._ring_order = ring_order

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self._write
        k = self._cache.keys[layer_idx]
        v = self._cache.values[layer_idx]
        if ring := self._cache.rings[layer_idx]:
            return ring_update(self._cache, k, v, self._rows, key_states, value_states, lo, hi, self._read_lo,
                               ring, self._ring_order)
        k[self._rows, :, lo:hi] = key_states
        v[self._rows, :, lo:hi] = value_states
        return k[self._rows, :, self._read_lo:hi], v[self._rows, :, self._read_lo:hi]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._write[1] - self._read_lo

    @property
    def is_compileable(self) -> bool:
        return False


def ring_update(cache: SlotKVCache, k: torch.Tensor, v: torch.Tensor, rows: slice | int, key_states: torch.Tensor,
                value_states: torch.Tensor, lo: int, hi: int, read_lo: int, ring: int,
                ring_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Write columns [lo, hi) of `rows` into a ring layer's `k`/`v`; return the keys and values to attend to: for a
    decode step (`ring_order`), what `ring_read` gives; for a prefill or a chunk, the keys still held from `read_lo`
    on before `lo`, in order, followed by the new ones."""
    if isinstance(rows, int):
        rows = slice(rows, rows + 1)
    if ring_order:
        if hi - lo != 1:
            raise ValueError("a ring-order read follows a one-column write")
        k[rows, :, lo % ring] = key_states[:, :, 0]
        v[rows, :, lo % ring] = value_states[:, :, 0]
        return ring_read(k, rows, read_lo, hi, ring), ring_read(v, rows, read_lo, hi, ring)
    old_lo = max(read_lo, lo - ring)
    if old_lo < lo:  # read before writing: the new columns may land where the oldest held ones are
        cols = cache.ring_columns(old_lo, lo, ring)
        key_states = torch.cat([k[rows][:, :, cols], key_states], dim=2)
        value_states = torch.cat([v[rows][:, :, cols], value_states], dim=2)
    kept = min(hi - lo, ring)
    cols = cache.ring_columns(hi - kept, hi, ring)
    k[rows, :, cols] = key_states[:, :, -kept:]
    v[rows, :, cols] = value_states[:, :, -kept:]
    return key_states, value_states


def whole_ring(span: int, ring: int) -> bool:
    """Whether a decode step reading `span` columns attends to a ring layer's whole ring, as stored (its masks
    then say which column is which, `window_kv.Rings.decode_masks`); a shorter span is read in order."""
    return span >= ring


def ring_read(t: torch.Tensor, rows: slice, read_lo: int, hi: int, ring: int) -> torch.Tensor:
    """A ring layer's columns [read_lo, hi) of `rows` for a decode step: the whole ring as stored when the span
    covers it (`whole_ring`), else those columns in order (a view, or two pieces joined where they wrap)."""
    if whole_ring(hi - read_lo, ring):
        return t[rows]
    a = read_lo % ring
    b = a + hi - read_lo
    if b <= ring:
        return t[rows, :, a:b]
    return torch.cat([t[rows, :, a:], t[rows, :, :b - ring]], dim=2)
