"""A chunk of a long prompt riding in the decode step's own forward (one pass over the weights per step).

Without it a chunked prefill is a second forward beside the decode step, and on hardware where a
forward's fixed cost (reading every weight) is about a decode step, every chunk doubles the step that
running rows wait on. Fused, the step's input is one packed sequence: one token per running row, then
the chunk's tokens, each with its own position. Everything but attention works token by token, so the
model's own projections, norms and MLPs serve the packed sequence unchanged. Attention is split back
apart: transformers' `sdpa` attention function is wrapped (`install`) so that, while a fused step runs
on this thread, it attends the rows' queries to their own cache rows (as a decode step would) and the
chunk's queries to the chunk's own cache row (as a chunk forward would), each with the model's own
masks for that layer; outside a fused step it is transformers' function, untouched.

Not every model can be driven this way (its own attention function, position biases, token-mixing
layers): `gpu_worker.exactness` runs a fused step at load and compares its logits with the model's own
forward; a model that does not match keeps its chunks as forwards of their own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from gpu_worker.kv_cache import ring_read, ring_update
from gpu_worker.packed_length import FUSED_PACK_ALIGN, aligned_chunk
from gpu_worker.sequences import GenResult

_LOCAL = threading.local()  # the fused step in progress on this thread, if any
_SDPA: Any = None  # transformers' own sdpa attention function


def install() -> None:
    """Wrap transformers' `sdpa` attention function (once per process; outside a fused step it only delegates)."""
    global _SDPA
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(current, "_batchgate_fused", False):
        return
    _SDPA = current
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _fused_or_sdpa


def _fused_or_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    pack: Pack | None = getattr(_LOCAL, "pack", None)
    if pack is None:
        return _SDPA(module, query, key, value, attention_mask, **kwargs)
    return pack.attend(module, query, kwargs)


_fused_or_sdpa._batchgate_fused = True  # type: ignore[attr-defined]


@dataclass
class Pack:
    """One fused step's layout: rows [0, n) decode one token each over cache columns [read_lo, end]; the
    chunk's queries are prompt positions [lo, hi) of cache row `slot`, attending to [0, hi)."""

    cache: Any  # the engine's SlotKVCache
    n: int
    read_lo: int
    end: int
    slot: int
    lo: int
    hi: int
    decode_masks: Any  # a mask, or {layer type: mask}, per `AttentionLayout.attention_mask`
    chunk_masks: Any
    layer_types: list[str] | None
    seen: set[int] = field(default_factory=set)
    # a ring layer's chunk keys and values (those still held before `lo`, then the chunk's), by layer
    chunk_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def _mask(self, masks: Any, layer: int) -> torch.Tensor:
        if isinstance(masks, dict):
            if self.layer_types is None:
                raise RuntimeError("masks by layer type, but the config names no layer types")
            return masks[self.layer_types[layer]]
        return masks

    def attend(self, module: Any, query: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
        layer = int(module.layer_idx)
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        n = self.n
        if query.shape[0] != 1 or query.shape[2] != n + self.hi - self.lo:
            raise RuntimeError(f"unexpected packed query shape {tuple(query.shape)}")
        q_rows = query[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, dim]
        if ring := self.cache.rings[layer]:
            row_k, row_v = (ring_read(t, slice(0, n), self.read_lo, self.end + 1, ring) for t in (keys, values))
        else:
            row_k, row_v = keys[:n, :, self.read_lo:self.end + 1], values[:n, :, self.read_lo:self.end + 1]
        rows_out, _ = _SDPA(module, q_rows, row_k, row_v, self._mask(self.decode_masks, layer), **kwargs)
        slot = slice(self.slot, self.slot + 1)
        chunk_k, chunk_v = self.chunk_kv.get(layer) or (keys[slot, :, :self.hi], values[slot, :, :self.hi])
        chunk_out = _chunk_attention(module, query[:, :, n:], chunk_k, chunk_v, self._mask(self.chunk_masks, layer),
                                     kwargs)
        self.seen.add(layer)
        # rows_out [n, 1, heads, dim] (sdpa returns [batch, q, heads, dim]); chunk_out [1, chunk, heads, dim]
        return torch.cat([rows_out.reshape(1, n, *rows_out.shape[2:]), chunk_out], dim=1), None


def _chunk_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     kwargs: dict[str, Any]) -> torch.Tensor:
    """The chunk's queries over its own cache row, [1, chunk, heads, dim]. Plain sdpa; grouped-query attention is
    done by the kernel where one takes it with a mask (`gqa_kernel_takes_mask`), else the keys are repeated per
    query head first. Anything beyond a plain masked attention (position biases, soft-capping, dropout) goes
    through transformers' own function."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("dropout"):
        return _SDPA(module, query, key, value, mask, **kwargs)[0]
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and not gqa_kernel_takes_mask(query.device):
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        groups = 1
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                           scale=kwargs.get("scaling"), enable_gqa=groups > 1)
    return out.transpose(1, 2)


def pack_align(device: torch.device) -> int:
    """What a fused step's packed sequence is cut to a multiple of (`gpu_worker.packed_length.FUSED_PACK_ALIGN`
    on CUDA, whose matrix products pick their kernels per shape; 1 elsewhere)."""
    return FUSED_PACK_ALIGN if device.type == "cuda" else 1


def gqa_kernel_takes_mask(device: torch.device) -> bool:
    """Whether a fused kernel does masked grouped-query attention on `device`. On CPU one does, and repeating the
    keys per query head there costs more than the attention itself for a chunk deep into a long prompt. On CUDA
    none does with cuDNN's off (`gpu_worker.models.attention_kernels`): torch falls back to its math kernel, a
    dozen small ops a layer at 0.4-0.7 ms of CPU each, so an H200's fused step cost 1.5-2.3x a bare one (measured).
    With the keys repeated, the memory-efficient kernel takes the mask, and the copy costs the GPU microseconds."""
    return device.type == "cpu"


class PackedWindow(Cache):
    """The cache as a fused step's layers see it: each row's new key/value goes to its cache row at column
    `end`, the chunk's to its own row at [lo, hi); attention reads the cache itself (`Pack.attend`)."""

    def __init__(self, pack: Pack) -> None:
        self.layers = []
        self._pack = pack

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._pack
        keys, values = p.cache.keys[layer_idx], p.cache.values[layer_idx]
        if ring := p.cache.rings[layer_idx]:
            keys[:p.n, :, p.end % ring] = key_states[0, :, :p.n].transpose(0, 1)
            values[:p.n, :, p.end % ring] = value_states[0, :, :p.n].transpose(0, 1)
            p.chunk_kv[layer_idx] = ring_update(p.cache, keys, values, p.slot, key_states[:, :, p.n:],
                                                value_states[:, :, p.n:], p.lo, p.hi, 0, ring, ring_order=False)
            return key_states, value_states
        keys[:p.n, :, p.end] = key_states[0, :, :p.n].transpose(0, 1)
        values[:p.n, :, p.end] = value_states[0, :, :p.n].transpose(0, 1)
        keys[p.slot, :, p.lo:p.hi] = key_states[0, :, p.n:]
        values[p.slot, :, p.lo:p.hi] = value_states[0, :, p.n:]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._pack.end - self._pack.read_lo

    @property
    def is_compileable(self) -> bool:
        return False


@torch.inference_mode()
def fused_step(engine: Any, budget: int) -> list[GenResult]:
    """One decode step for every running row with up to `budget` tokens of the chunked prompt in the same
    forward; the rows that finished, and the prompt's row once its last chunk is in (if already done)."""
    e = engine
    chunked = e.chunked
    cur = chunked.current
    t0 = e._clock()
    e._make_room_right()
    prompt = cur.spec.prompt_ids
    n = len(e.rows)
    dev = e.device
    left = len(prompt) - cur.done  # a prompt's last chunk is taken whole when it fits: never cut into two steps
    lo, hi = cur.done, cur.done + (left if left <= budget else aligned_chunk(n, budget, pack_align(dev)))
    read_lo = min(r.start for r in e.rows)
    decode_masks, row_pos = e._decode_masks(read_lo)
    q_pos = torch.arange(lo, hi, device=dev)[None]
    k_pos = torch.arange(0, hi, device=dev)[None]
    chunk_masks = e.rings.tail(e._mask(k_pos[:, None, None, :] <= q_pos[:, None, :, None], q_pos, k_pos), lo, hi)
    pack = Pack(e.cache, n, read_lo, e.end, chunked.slot, lo, hi, decode_masks, chunk_masks, e.layer_types)
    ids = torch.tensor([[r.tokens[-1] for r in e.rows] + list(prompt[lo:hi])], dtype=torch.long, device=dev)
    positions = torch.cat([row_pos[:, 0], q_pos[0]])[None]
    done_prompt = hi == len(prompt)
    keep = list(range(n))  # the rows' logits; the chunk's: every position's when scored, else the prompt's last
    if e.prompt_logprobs.wanted([cur.spec]):
        keep += range(n, ids.shape[1])
    elif done_prompt:
        keep.append(ids.shape[1] - 1)
    dummy = e._mask(torch.ones((1, 1, 1, 1), dtype=torch.bool, device=dev), q_pos[:, :1], q_pos[:, :1])
    f0 = time.perf_counter()
    _LOCAL.pack = pack
    try:
        out = e.model(input_ids=ids, attention_mask=dummy, position_ids=positions, **{e.cache_arg: PackedWindow(pack)},
                      use_cache=True, logits_to_keep=torch.tensor(keep, device=dev))
    finally:
        _LOCAL.pack = None
    if len(pack.seen) != e.cache.layers:
        raise RuntimeError(f"a fused step reached {len(pack.seen)} of {e.cache.layers} attention layers")
    forward_s = time.perf_counter() - f0
    logits = out.logits[0]
    e.prompt_logprobs.chunk(cur.spec, logits[n:], lo)
    finished, now = e._advance(logits[:n], read_lo, forward_s, t0)
    e.stats.prefill_tokens += hi - lo
    e.stats.prefill_padded_tokens += hi - lo
    # the chunk's share of the forward, by tokens: what the prefill fit learns from
    chunked.last = (hi - lo, forward_s * (hi - lo) / (n + hi - lo))
    cur.done = hi
    out_rows = e._retire(finished, now)
    if done_prompt:
        out_rows += chunked.join(logits[-1:])
    return out_rows
