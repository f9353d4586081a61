"""Chunked prefill: a long prompt is prefilled a chunk at a time, one chunk per engine step, while the
running rows keep decoding (Sarathi-Serve's idea, on the engine's right-aligned cache).

The prompt is written into a cache row of its own (the engine's last row, kept out of the running
batch meanwhile), left-aligned: chunk i covers positions [lo, hi), attends to [0, hi) with the
model's own per-layer pattern (causal, windows). After the last chunk its first token is sampled and
the row joins the running batch: its cache is copied right-aligned to the batch's `end`, as if it had
been prefilled there in one forward. Between two tokens a running row then waits one decode step plus
one chunk, and the chunk's size is the scheduler's to choose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.sequences import GenResult, GenSpec
from shared.states import FinishReason


@dataclass(slots=True)
class _Prompt:
    spec: GenSpec
    done: int  # prompt tokens already in the cache
    admitted_at: float


class ChunkedPrefill:
    def __init__(self, engine: Any) -> None:  # the GenerationEngine that owns it (no import: it imports this)
        self.engine = engine
        self.current: _Prompt | None = None
        self.last = (0, 0.0)  # (tokens, seconds) of the chunk the last step prefilled

    @property
    def slot(self) -> int:
        """The cache row it writes into, outside the running batch: the last one (as the running batch's view of
        the cache, which starts at its `base`, numbers it)."""
        return self.engine.max_rows - 1 - self.engine.cache.base

    @property
    def active(self) -> bool:
        return self.current is not None

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (0 when none is in progress)."""
        return len(self.current.spec.prompt_ids) - self.current.done if self.current else 0

    def begin(self, spec: GenSpec) -> None:
        self.current = _Prompt(spec, 0, self.engine._clock())

    def cancel(self, ids: set[str], reason: FinishReason) -> list[GenResult]:
        cur = self.current
        if cur is None or cur.spec.id not in ids:
            return []
        self.current = None
        self.engine.prompt_logprobs.take(cur.spec.id)  # what its chunks kept
        return [GenResult(id=cur.spec.id, token_ids=[], finish_reason=reason, prompt_tokens=len(cur.spec.prompt_ids),
                          admitted_at=cur.admitted_at, owner=cur.spec.owner)]

    @torch.inference_mode()
    def advance(self, budget: int) -> list[GenResult]:
        """Prefill up to `budget` more prompt tokens; after the last chunk the row joins the running batch
        (returned if it is already done)."""
        cur = self.current
        self.last = (0, 0.0)
        if cur is None or budget <= 0:
            return []
        e = self.engine
        prompt = cur.spec.prompt_ids
        lo, hi = cur.done, min(len(prompt), cur.done + budget)
        q_pos = torch.arange(lo, hi, device=e.device)[None]
        k_pos = torch.arange(0, hi, device=e.device)[None]
        allowed = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
        f0 = time.perf_counter()
        out = e.model(input_ids=torch.tensor([prompt[lo:hi]], dtype=torch.long, device=e.device),
                      attention_mask=e.rings.tail(e._mask(allowed, q_pos, k_pos), lo, hi), position_ids=q_pos,
                      **{e.cache_arg: e.cache.window(slice(self.slot, self.slot + 1), lo, hi, 0)},
                      use_cache=True, logits_to_keep=0 if e.prompt_logprobs.wanted([cur.spec]) else 1)
        e.prompt_logprobs.chunk(cur.spec, out.logits[0], lo)
        self.last = (hi - lo, time.perf_counter() - f0)
        e.stats.forward_s += self.last[1]
        e.stats.prefill_tokens += hi - lo
        e.stats.prefill_padded_tokens += hi - lo
        cur.done = hi
        if hi < len(prompt):
            return []
        return self.join(out.logits[:, -1, :])

    def join(self, logits: torch.Tensor) -> list[GenResult]:
        """The whole prompt is in its cache row and `logits` ([1, vocab]) came from its last position: the row
        joins the running batch right-aligned at `end` (returned if it is already done)."""
        cur = self.current
        if cur is None:
            raise RuntimeError("no chunked prompt to join")
        self.current = None
        e = self.engine
        n = len(cur.spec.prompt_ids)
        e._make_room_left(n)
        e.cache.copy_span(self.slot, 0, len(e.rows), e.end - n, n)
        return e._admit([cur.spec], logits, cur.admitted_at)
