"""Sliding-window layers keep only the keys they can still see: a ring of their window's columns.

A layer that attends to the last W positions never reads a key older than that, so its part of the
cache needs W columns per row, not twice the longest sequence (Mistral with a window, Gemma 2/3,
Cohere 2, Qwen 2/3 with sliding layers: most or all of their layers). The cache keeps such a layer's
keys in a ring (`SlotKVCache.rings`): the key of absolute column c sits at column c mod W of its row,
for every row (running, parked, the chunked prompt's), so a row's last W keys are always in place.

What each kind of forward reads from a ring layer (`kv_cache.CacheWindow`, `fused_step`):
- a decode step writes its column, then attends to the whole ring as it is stored once the rows' span
  covers it; its mask for the windowed layer type is then built over the ring's columns
  (`Rings.decode_masks`: column j holds absolute column end - (end - j) mod W; a column before the row's
  start is masked). A shorter span is read in order (`kv_cache.ring_read`), so short rows under a long
  window read no more than they would without a ring;
- a prefill or a chunk reads the keys still held before the columns it writes (at most W), in order,
  followed by its own new keys; its mask is the usual one, cut to those trailing columns (`Rings.tail`).
A layer whose window is not shorter than a sequence can be keeps every column, as do full and chunked
layers. The greedy tokens of every windowed architecture equal `generate` past the window
(`tests/integration/test_architectures.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.attention import AttentionLayout
from gpu_worker.kv_cache import kv_shape, text_config, whole_ring


@dataclass(frozen=True)
class Rings:
    by_type: dict[str, int]  # layer type -> ring width (its window), for the windowed types that keep a ring
    per_layer: list[int]  # each layer's ring width; 0: every column kept
    single: bool  # the model takes one mask for every layer (so every layer is windowed alike)

    @classmethod
    def of(cls, layout: AttentionLayout, layer_types: list[str] | None, layers: int, max_seq_len: int) -> Rings:
        """Rings for the windowed layer types whose window is shorter than `max_seq_len` (beyond it, a ring
        saves nothing)."""
        by_type = {t: p.window for t, p in layout.patterns.items()
                   if p.window is not None and p.chunk is None and p.window < max_seq_len}
        if not layout.by_type:
            width = next(iter(by_type.values()), 0)
            return cls(by_type, [width] * layers, single=True)
        if layer_types is None or len(layer_types) < layers:
            return cls({}, [0] * layers, single=False)
        return cls(by_type, [by_type.get(t, 0) for t in layer_types[:layers]], single=False)

    @classmethod
    def for_model(cls, model: Any, max_seq_len: int) -> Rings:
        return cls.of(AttentionLayout.of(model), getattr(text_config(model), "layer_types", None),
                      kv_shape(model)[0], max_seq_len)

    @property
    def any(self) -> bool:
        return bool(self.by_type)

    def decode_masks(self, masks: Any, build: Any, end: int, read_lo: int, starts: torch.Tensor,
                     q_pos: torch.Tensor) -> Any:
        """`masks` (as `AttentionLayout.attention_mask` gives them, over columns [read_lo, end]) with each ring
        type's replaced by one over its ring as stored where a decode step reads the whole ring
        (`kv_cache.whole_ring`), for rows whose tokens start at `starts` and whose queries sit at column `end`
        (positions `q_pos`, [rows, 1]); `build(allowed, q_pos, k_pos)` makes masks."""
        if not self.by_type:
            return masks
        out = dict(masks) if isinstance(masks, dict) else masks
        for width in set(self.by_type.values()):
            if not whole_ring(end + 1 - read_lo, width):
                continue  # read in order: the usual masks hold
            cols = end - (end - torch.arange(width, device=starts.device)) % width  # absolute column at each slot
            allowed = (cols[None, :] >= starts[:, None])[:, None, None, :]
            ring = build(allowed, q_pos, cols[None, :] - starts[:, None])
            if self.single:
                return ring
            for layer_type, w in self.by_type.items():
                if w == width:
                    out[layer_type] = ring[layer_type]
        return out

    def tail(self, masks: Any, write_lo: int, write_hi: int, read_lo: int = 0) -> Any:
        """`masks` over key columns [read_lo, write_hi) of a forward writing [write_lo, write_hi), with each
        ring type's cut to the keys a ring layer returns: those still held before `write_lo`, then the new ones."""
        if not self.by_type:
            return masks
        if self.single:
            return masks[..., -self.keys_seen(write_lo, write_hi, read_lo, self.per_layer[0]):]
        out = dict(masks)
        for layer_type, width in self.by_type.items():
            out[layer_type] = masks[layer_type][..., -self.keys_seen(write_lo, write_hi, read_lo, width):]
        return out

    @staticmethod
    def keys_seen(write_lo: int, write_hi: int, read_lo: int, width: int) -> int:
        """Keys a ring layer of `width` columns returns to a forward writing [write_lo, write_hi) that would read
        from `read_lo`: the held ones before `write_lo` (at most `width`), then the new ones."""
        return write_hi - max(read_lo, write_lo - width)
